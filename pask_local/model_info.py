"""Model facts the KV policies need: which layers use sliding-window attention, and the window."""

from __future__ import annotations

import ctypes
from functools import cache

from .errors import NativeError
from .llm import Model, _raw
from .native import bind


@cache
def _is_swa_fn():
    return bind("pask_model_layer_is_swa", ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32])


def swa_layers(model: Model) -> tuple[tuple[int, ...], int]:
    """(indices of sliding-window layers, window size); ((), 0) for all-global models."""
    window = int(_raw().llama_model_n_swa(model.ptr))
    if window <= 0:
        return (), 0
    fn = _is_swa_fn()
    flags = [fn(model.ptr, il) for il in range(model.n_layer)]
    if any(f < 0 for f in flags):
        raise NativeError("pask_model_layer_is_swa failed")
    return tuple(il for il, f in enumerate(flags) if f == 1), window
