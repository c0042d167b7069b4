"""Grammar-constrained decoding: the native parser state (``state``) and the fast sampler (``sampler``)."""
