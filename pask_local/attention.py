"""Attention statistics from our native probe (patches 0004, 0007), for score-based methods.

``AttentionProbe`` owns a ``pask_attn_probe``. After each decode, ``stat(il, what)`` returns, per KV
cell (column) of layer ``il``, the attention mass summed over queries and heads (``SUM``), over the
last ``n_window`` queries (``WINDOW``), or the last query's attention averaged over heads (``LAST``).
Two ways to feed it:
- ``attach(ctx, stats, n_cells)`` (what the engine uses): the context's decode graph computes the
  statistics itself into per-layer accumulators (patch 0007): no eval callback, no host copy while
  decoding, flash attention and quantized K/V allowed;
- ``install(params)`` (the reference the in-graph mode is tested against): an eval callback on the
  softmax tensors, set before the context is created; flash attention off.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from .errors import NativeError
from .native import NativeHandle, bind

SUM, WINDOW, LAST = 0, 1, 2


def _statistic(what: int) -> int:
    """``what`` if it names a statistic (SUM, WINDOW, LAST), else a one-line NativeError."""
    if what not in (SUM, WINDOW, LAST):
        raise NativeError(f"attention probe: unknown statistic {what!r} (SUM, WINDOW or LAST)")
    return what


class _Fns:
    def __init__(self) -> None:
        p = ctypes.c_void_p
        self.init = bind("pask_attn_probe_init", p, [ctypes.c_int32, ctypes.c_int32])
        self.free = bind("pask_attn_probe_free", None, [p])
        self.reset = bind("pask_attn_probe_reset", None, [p])
        self.set_enabled = bind("pask_attn_probe_set_enabled", None, [p, ctypes.c_int32])
        self.n_kv_seq = bind("pask_attn_probe_n_kv_seq", ctypes.c_int32, [p, ctypes.c_int32, ctypes.c_int32])
        self.get_seq = bind("pask_attn_probe_get_seq", ctypes.c_int32,
                            [p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_float),
                             ctypes.c_int32])
        self.attach = bind("pask_attn_probe_attach", ctypes.c_int32, [p, p, ctypes.c_int32, ctypes.c_int32])
        self.detach = bind("pask_attn_probe_detach", None, [p])
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

    def attach(self, ctx, stats: tuple[int, ...] = (SUM, WINDOW, LAST), n_cells: int | None = None) -> None:
        """Have ``ctx``'s decode graph compute ``stats`` (per layer, up to ``n_cells`` KV cells each)."""
        mask = 0
        for what in stats:
            mask |= 1 << _statistic(what)
        n = int(n_cells if n_cells is not None else ctx.n_ctx)
        if self._f.attach(ctx.address, self._ptr, mask, n) != 0:
            raise NativeError(f"pask_attn_probe_attach failed ({self.n_layer} layers, {n} cells, statistics {mask})")
        self._ctx = ctx

    def detach(self) -> None:
        ctx, self._ctx = getattr(self, "_ctx", None), None
        if ctx is not None and getattr(ctx, "_ptr", None):
            self._f.detach(ctx.address)

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

    def n_kv(self, il: int, seq_id: int = 0) -> int:
        """Cells recorded for layer ``il`` (in-graph on a multi-stream cache: sequence ``seq_id``'s stream)."""
        n = self._f.n_kv_seq(self._ptr, il, seq_id)
        if n == -2:
            raise NativeError(f"attention probe: a layer attended more KV cells than the probe holds (layer {il})")
        if n < 0:
            raise NativeError(f"attention probe: bad layer {il} or sequence {seq_id}")
        return n

    def stat(self, il: int, what: int = SUM, seq_id: int = 0) -> np.ndarray:
        _statistic(what)
        n = self.n_kv(il, seq_id)
        out = np.zeros(n, dtype=np.float32)
        if n:
            self._f.get_seq(self._ptr, il, what, seq_id, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
        return out

    def close(self) -> None:
        self.detach()  # a context that outlives its probe must not keep computing into freed tensors
        super().close()

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


def probed_layered_context(model, capacities, config, probe: AttentionProbe | None, unified: bool = False,
                           stats: tuple[int, ...] = (SUM, WINDOW, LAST), in_graph: bool = True):
    """A LayeredContext whose decode graph computes ``probe``'s ``stats`` (if a probe is given).

    ``in_graph=False`` feeds the probe from an eval callback instead (flash attention off): the
    reference the in-graph statistics are tested against.
    """
    from .kv_layered import LayeredContext

    if probe is None or in_graph:
        ctx = LayeredContext(model, capacities, config, unified=unified)
        if probe is not None:
            try:
                probe.attach(ctx, stats, max(capacities))
            except BaseException:
                ctx.close()
                raise
        return ctx

    class _Probed(LayeredContext):
        def params(self):  # noqa: D401 - LayeredContext builds its context from these params
            p = super().params()
            probe.install(p)
            return p

    return _Probed(model, capacities, config, unified=unified)
