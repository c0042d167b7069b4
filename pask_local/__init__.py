"""pask-local: Parser-Aware Structural KV persistence for local function calling on llama.cpp.

The package layout follows the architecture: ``native`` binds our patched libllama,
``models`` resolves GGUF files, ``classes`` holds the structural class enum shared by tagging,
policies, calibration and the TUI, and ``cli`` is the ``pask-local`` command.
"""

__version__ = "0.1.0"
