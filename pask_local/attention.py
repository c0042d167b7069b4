"""Attention statistics from our native probe (patch 0004), for score-based baselines.

``AttentionProbe`` owns a ``pask_attn_probe``; ``install(params)`` puts its eval callback into a
``llama_context_params`` before the context is created (flash attention must be off). After each
decode, ``stat(il, what)`` returns, per KV cell (column) of layer ``il``, the attention mass summed
over queries and heads (``SUM``), over the last ``n_window`` queries (``WINDOW``), or the last
query's attention averaged over heads (``LAST``). The callback runs natively: no Python per tensor.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from .errors import NativeError
from .native import NativeHandle, bind

SUM, WINDOW, LAST = 0, 1, 2


class _Fns:
    def __init__(self) -> None:
        p = ctypes.c_void_p
        self.init = bind("pask_attn_probe_init", p, [ctypes.c_int32, ctypes.c_int32])
        self.free = bind("pask_attn_probe_free", None, [p])
        self.reset = bind("pask_attn_probe_reset", None, [p])
        self.set_enabled = bind("pask_attn_probe_set_enabled", None, [p, ctypes.c_int32])
        self.n_kv = bind("pask_attn_probe_n_kv", ctypes.c_int32, [p, ctypes.c_int32])
        self.get = bind("pask_attn_probe_get", ctypes.c_int32,
                        [p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_float), ctypes.c_int32])
        from .native import lib

        self.cb_addr = ctypes.cast(lib().pask_attn_probe_cb, ctypes.c_void_p).value


@functools.cache
def _fns() -> _Fns:
    return _Fns()


class AttentionProbe(NativeHandle):
    def __init__(self, n_layer: int, n_window: int = 32) -> None:
        self._f = _fns()
        self.n_layer = n_layer
        if not 0 < n_layer <= 1 << 16 or n_window < 0:
            raise NativeError(f"attention probe: need 0 < n_layer <= 65536 and n_window >= 0, got {n_layer}, {n_window}")
        self._ptr = self._f.init(n_layer, n_window)
        if not self._ptr:
            raise NativeError(f"pask_attn_probe_init({n_layer}, {n_window}) failed")

    def install(self, params) -> None:
        """Set cb_eval/cb_eval_user_data of a llama_context_params; forces flash attention off."""
        import llama_cpp.llama_cpp as raw

        params.cb_eval = raw.ggml_backend_sched_eval_callback(self._f.cb_addr)
        params.cb_eval_user_data = self._ptr
        params.flash_attn_type = raw.LLAMA_FLASH_ATTN_TYPE_DISABLED

    def reset(self) -> None:
        self._f.reset(self._ptr)

    def set_enabled(self, on: bool) -> None:
        """Stop (False) or resume observing; a stopped probe costs the decode no host copies."""
        self._f.set_enabled(self._ptr, int(on))

    def n_kv(self, il: int) -> int:
        n = self._f.n_kv(self._ptr, il)
        if n < 0:
            raise NativeError(f"attention probe: bad layer {il}")
        return n

    def stat(self, il: int, what: int = SUM) -> np.ndarray:
        if what not in (SUM, WINDOW, LAST):
            raise NativeError(f"attention probe: unknown statistic {what!r} (SUM, WINDOW or LAST)")
        n = self.n_kv(il)
        out = np.zeros(n, dtype=np.float32)
        if n:
            self._f.get(self._ptr, il, what, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
        return out

    def _release(self, ptr) -> None:
        self._f.free(ptr)


_CELL_POS = None


def cell_positions(ctx, il: int, seq_id: int = 0) -> np.ndarray:
    """Position held by each KV cell of layer ``il`` for ``seq_id`` (-1: empty/other sequence).

    Column j of a probe statistic is cell j, so ``cell_positions(ctx, il)[j]`` is its position.
    """
    global _CELL_POS
    if _CELL_POS is None:
        _CELL_POS = bind("pask_kv_cell_positions", ctypes.c_int32,
                         [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                          ctypes.c_int32])
    ptr = ctx.address
    n = _CELL_POS(ptr, il, seq_id, None, 0)
    if n < 0:
        raise NativeError(f"cell positions of layer {il}, sequence {seq_id}: {_last_error()}")
    out = np.full(max(n, 1), -1, dtype=np.int32)
    _CELL_POS(ptr, il, seq_id, out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n)
    return out[:n]


def _last_error() -> str:
    from .kv_layered import api

    return (api().last_error() or b"").decode() or "pask_kv_cell_positions failed"


def probed_layered_context(model, capacities, config, probe: AttentionProbe | None, unified: bool = False):
    """A LayeredContext whose llama_context_params carry ``probe``'s eval callback (if any)."""
    from .kv_layered import LayeredContext

    class _Probed(LayeredContext):
        def params(self):  # noqa: D401 - LayeredContext builds its context from these params
            p = super().params()
            if probe is not None:
                probe.install(p)
            return p

    return _Probed(model, capacities, config, unified=unified)
