"""pask_local.calibration: the torch side (GGUF weights -> torch reference model -> policy file)."""
