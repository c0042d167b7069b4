"""Python side of the layered KV cache (patch 0002, ``include/pask-kv.h``).

A ``LayeredContext`` is a ``llm.Context`` whose KV memory holds one cache per attention layer, each
with its own capacity (cells per sequence stream). Every layer keeps and evicts its own positions:
``evict(layer, positions)`` frees cells of one layer only, and ``llama_decode`` returns a non-zero
status (``Context.decode``) when some layer has no free cell for the batch. Bad input raises
``LayeredKVError`` (a ``PaskError``) before reaching C; C-side refusals raise it too. Any architecture
whose attention layers go through llama.cpp's standard KV cache (plain or iSWA) works; others
(recurrent, hybrid, MLA, ...) raise ``UnsupportedArchitectureError`` naming the architecture.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Iterable, Sequence

from .errors import PaskError
from .llm import Context, ContextConfig, Model
from .native import bind

_POS = ctypes.c_int32
_E_NAMES = {-1: "not a layered context", -2: "bad layer", -3: "bad sequence id", -4: "bad argument",
            -5: "unsupported architecture"}
E_ARCH = -5


class LayeredKVError(PaskError):
    """A layered-KV-cache call got bad input or the native side refused it."""


class UnsupportedArchitectureError(LayeredKVError):
    """The model's architecture has no standard KV cache to layer (recurrent, hybrid, MLA, ...)."""


class _Api:
    """The pask_kv_* functions of libllama, bound once."""

    def __init__(self) -> None:
        ctx_p = ctypes.c_void_p
        self.init = bind("pask_init_from_model", ctx_p, [ctx_p, _context_params_type(),
                                                          ctypes.POINTER(ctypes.c_uint32), ctypes.c_int32])
        self.model_supported = bind("pask_kv_model_supported", ctypes.c_int32, [ctx_p])
        self.n_seq_ids = bind("pask_kv_n_seq_ids", ctypes.c_int32, [ctx_p])
        self.n_layer = bind("pask_kv_n_layer", ctypes.c_int32, [ctx_p])
        self.capacity = bind("pask_kv_capacity", ctypes.c_int32, [ctx_p, ctypes.c_int32])
        self.evict = bind("pask_kv_evict", ctypes.c_int32,
                          [ctx_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(_POS), ctypes.c_int32])
        self.used = bind("pask_kv_used", ctypes.c_int32, [ctx_p, ctypes.c_int32, ctypes.c_int32])
        self.free = bind("pask_kv_free", ctypes.c_int32, [ctx_p, ctypes.c_int32, ctypes.c_int32])
        self.positions = bind("pask_kv_positions", ctypes.c_int32,
                              [ctx_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(_POS), ctypes.c_int32])
        self.layer_bytes = bind("pask_kv_layer_bytes", ctypes.c_int32,
                                [ctx_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)])
        self.total_bytes = bind("pask_kv_total_bytes", ctypes.c_int64, [ctx_p])
        self.last_error = bind("pask_kv_last_error", ctypes.c_char_p, [])


def _raw():
    import llama_cpp.llama_cpp as raw

    return raw


def _context_params_type():
    return _raw().llama_context_params


_API: _Api | None = None


def api() -> _Api:
    global _API
    if _API is None:
        _API = _Api()
    return _API


def _check(rc: int, what: str) -> int:
    if rc < 0:
        reason = (api().last_error() or b"").decode() or _E_NAMES.get(rc, f"error {rc}")
        raise LayeredKVError(f"{what}: {reason}")
    return rc


def _ptr(ctx: Context) -> int:
    return ctx.address


def _index(value: object, what: str) -> int:
    try:
        return operator.index(value)  # int, numpy integers; not floats or bools-as-strings
    except TypeError:
        raise LayeredKVError(f"{what} must be an integer, got {value!r}") from None


def unsupported_reason(model: Model) -> str | None:
    """None if ``model`` can use a layered KV cache, else a one-line reason naming its architecture."""
    if api().model_supported(model.ptr) == 0:
        return None
    return (api().last_error() or b"").decode() or "the layered KV cache does not support this architecture"


def require_supported(model: Model) -> None:
    """Raise ``UnsupportedArchitectureError`` unless ``model`` can use a layered KV cache."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise UnsupportedArchitectureError(reason)


def kv_total_bytes(ctx: Context) -> int:
    """Bytes allocated by any context's KV memory (full or layered)."""
    n = api().total_bytes(_ptr(ctx))
    if n < 0:
        raise LayeredKVError("the context has no KV memory")
    return int(n)


class LayeredContext(Context):
    """A context whose KV cache gives every layer its own cells and capacity."""

    def __init__(self, model: Model, capacities: Sequence[int], config: ContextConfig | None = None,
                 unified: bool = False) -> None:
        """``capacities[il]``: cells of layer il per stream (one stream per sequence unless ``unified``)."""
        self.unified = unified
        caps = [int(c) for c in capacities]
        if len(caps) != model.n_layer:
            raise LayeredKVError(f"need one capacity per layer: got {len(caps)}, model has {model.n_layer} layers")
        bad = [i for i, c in enumerate(caps) if c < 1]
        if bad:
            raise LayeredKVError(f"capacity of layer {bad[0]} is {caps[bad[0]]}; every layer needs at least 1 cell")
        config = config or ContextConfig()
        if config.n_seq_max < 1:
            raise LayeredKVError("n_seq_max must be >= 1")
        require_supported(model)
        self.model = model
        self.config = config
        arr = (ctypes.c_uint32 * len(caps))(*caps)
        raw_ptr = api().init(model.ptr, self.params(), arr, len(caps))
        if not raw_ptr:
            reason = (api().last_error() or b"").decode() or "unknown reason"
            raise LayeredKVError(f"cannot create a layered-cache context: {reason}")
        super().__init__(model, config, ptr=ctypes.c_void_p(raw_ptr))
        self.capacities = caps
        #: sequence ids the cache accepts: n_seq_max with a stream per sequence, else (one shared
        #: stream, as upstream's KV cache) LLAMA_MAX_SEQ
        self.n_seq_ids = _check(api().n_seq_ids(_ptr(self)), "n_seq_ids")

    def params(self):
        p = super().params()
        p.kv_unified = self.unified
        return p

    @property
    def n_layer(self) -> int:
        return _check(api().n_layer(_ptr(self)), "n_layer")

    def _layer(self, layer: int) -> int:
        i = _index(layer, "layer")
        if not 0 <= i < len(self.capacities):
            raise LayeredKVError(f"layer {layer!r} out of range [0, {len(self.capacities)})")
        return i

    def _seq(self, seq_id: int) -> int:
        i = _index(seq_id, "sequence id")
        if not 0 <= i < self.n_seq_ids:
            raise LayeredKVError(f"sequence id {seq_id!r} out of range [0, {self.n_seq_ids})")
        return i

    def capacity(self, layer: int) -> int:
        return _check(api().capacity(_ptr(self), self._layer(layer)), "capacity")

    def evict(self, layer: int, positions: Iterable[int], seq_id: int = 0) -> int:
        """Drop ``positions`` of ``seq_id`` from ``layer`` only; returns the number of cells freed."""
        pos = [_index(p, "position") for p in positions]
        neg = [p for p in pos if p < 0]
        if neg:
            raise LayeredKVError(f"negative position {neg[0]} cannot be evicted")
        arr = (_POS * max(1, len(pos)))(*pos)
        rc = api().evict(_ptr(self), self._layer(layer), self._seq(seq_id), arr, len(pos))
        return _check(rc, f"evict from layer {layer}")

    def used(self, layer: int, seq_id: int = 0) -> int:
        """Cells of ``layer`` holding ``seq_id``."""
        return _check(api().used(_ptr(self), self._layer(layer), self._seq(seq_id)), "used")

    def free(self, layer: int, seq_id: int = 0) -> int:
        """Free cells of ``layer`` in the stream of ``seq_id``."""
        return _check(api().free(_ptr(self), self._layer(layer), self._seq(seq_id)), "free")

    def positions(self, layer: int, seq_id: int = 0) -> list[int]:
        """Positions of ``seq_id`` held by ``layer``, in cell order."""
        li, si = self._layer(layer), self._seq(seq_id)
        n = _check(api().positions(_ptr(self), li, si, None, 0), "positions")
        arr = (_POS * max(1, n))()
        n2 = _check(api().positions(_ptr(self), li, si, arr, n), "positions")
        return list(arr[:min(n, n2)])

    def layer_bytes(self, layer: int) -> tuple[int, int]:
        """(K bytes, V bytes) allocated for ``layer``."""
        k, v = ctypes.c_int64(), ctypes.c_int64()
        _check(api().layer_bytes(_ptr(self), self._layer(layer), ctypes.byref(k), ctypes.byref(v)), "layer_bytes")
        return int(k.value), int(v.value)

    def seq_cp(self, src: int, dst: int) -> None:
        """Copy the whole sequence ``src`` to ``dst`` in every layer (upstream llama_memory_seq_cp)."""
        _raw().llama_memory_seq_cp(self.memory, self._seq(src), self._seq(dst), -1, -1)

    def seq_keep(self, seq_id: int) -> None:
        """Drop every sequence but ``seq_id`` from every layer (upstream llama_memory_seq_keep)."""
        _raw().llama_memory_seq_keep(self.memory, self._seq(seq_id))

    def kv_bytes(self) -> int:
        """Total K+V bytes of all layers."""
        return sum(sum(self.layer_bytes(i)) for i in range(len(self.capacities)))
