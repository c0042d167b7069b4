"""Python side of the native persistence step (patch 0006, ``include/pask-step.h``).

``NativeStep`` owns one request's ``pask_step``: the class of every position, one rule per layer
(``methods.base.StepRule`` plus the layer's capacity, growth and sliding window), the per-position
attention scores (read natively from the probe) and a queue of eviction events for traces. The
engine calls ``token`` once per generated token: no Python runs per layer. ``select`` runs the
native selection on explicit arrays, so tests can hold it against each method's Python ``select``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import NativeError
from .methods.base import StepRule
from .native import NativeHandle, bind

MAX_CLASSES = 32
KINDS = {"quota": 0, "topk": 1, "sink_recent": 2}
ORDERS = {"oldest-first": 0, "newest-first": 1, "span-head": 2, "attention": 3, "tool-relevance": 4}
RULE_CODES = {"policy": 0, "score": 1, "window": 2}
RULE_NAMES = {v: k for k, v in RULE_CODES.items()}


class _Rule(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32), ("cap", ctypes.c_int32), ("ratio", ctypes.c_double),
        ("swa_window", ctypes.c_int32), ("rule_code", ctypes.c_int32), ("hysteresis", ctypes.c_int32),
        ("protect_newest", ctypes.c_int32), ("protect_ratio", ctypes.c_double),
        ("protect_from", ctypes.c_int32), ("pool_kernel", ctypes.c_int32), ("n_sink", ctypes.c_int32),
        ("recent", ctypes.c_int32), ("never_mask", ctypes.c_uint32), ("order", ctypes.c_int32),
        ("keep", ctypes.c_double * MAX_CLASSES), ("rank", ctypes.c_int32 * MAX_CLASSES),
    ]


@dataclass(frozen=True)
class LayerRule:
    """A method's ``StepRule`` placed on one layer: its prompt capacity, growth and window."""

    rule: StepRule
    cap: int
    ratio: float
    swa_window: int = 0
    rule_code: str = "policy"
    hysteresis: int = 0   # an over-target layer evicts down to target - hysteresis


def _struct(lr: LayerRule) -> _Rule:
    r = lr.rule
    if r.kind not in KINDS or r.order not in ORDERS:
        raise NativeError(f"unknown step rule kind {r.kind!r} or order {r.order!r}")
    out = _Rule(kind=KINDS[r.kind], cap=int(lr.cap), ratio=float(lr.ratio), swa_window=int(lr.swa_window),
                rule_code=RULE_CODES[lr.rule_code], hysteresis=int(lr.hysteresis), protect_newest=r.protect_newest,
                protect_ratio=float(r.protect_ratio), protect_from=r.protect_from, pool_kernel=r.pool_kernel,
                n_sink=r.n_sink, recent=r.recent, order=ORDERS[r.order])
    out.never_mask = sum(1 << c for c in set(r.never))
    for i, k in enumerate(r.keep):
        out.keep[i] = k
    for i, k in enumerate(r.rank):
        out.rank[i] = k
    return out


class _Fns:
    def __init__(self) -> None:
        p, i32 = ctypes.c_void_p, ctypes.c_int32
        ip = ctypes.POINTER(i32)
        self.init = bind("pask_step_init", p, [p, i32, ctypes.POINTER(_Rule), i32, ip, i32, i32, i32, i32, p, i32])
        self.free = bind("pask_step_free", None, [p])
        self.set_trace = bind("pask_step_set_trace", None, [p, i32])
        self.set_priority = bind("pask_step_set_priority", i32, [p, ctypes.POINTER(ctypes.c_double), i32])
        self.set_scores = bind("pask_step_set_scores", i32, [p, i32, ctypes.POINTER(ctypes.c_double), i32])
        self.collect = bind("pask_step_collect", i32, [p, i32])
        self.evict_to = bind("pask_step_evict_to", i32, [p, i32, i32, i32, i32])
        self.drop_window = bind("pask_step_drop_window", i32, [p, i32, i32])
        self.token = bind("pask_step_token", i32, [p, i32, i32, i32, ip])
        self.take_events = bind("pask_step_take_events", i32, [p, ip, i32])
        self.compact = bind("pask_step_compact", i32, [p])
        self.select = bind("pask_step_select", i32,
                           [ctypes.POINTER(_Rule), ip, ip, ctypes.POINTER(ctypes.c_double), i32, ip, i32, i32, i32,
                            ctypes.POINTER(ctypes.c_uint8)])


@functools.cache
def _fns() -> _Fns:
    return _Fns()


def _check(rc: int, what: str) -> int:
    if rc < 0:
        from .kv_layered import api

        reason = (api().last_error() or b"").decode() or f"error {rc}"
        raise NativeError(f"{what}: {reason}")
    return rc


def _i32(a: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.int32))


def _iptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))


def select(rule: LayerRule | StepRule, positions: Sequence[int], classes: Sequence[int],
           scores: Sequence[float] | None, all_classes: Sequence[int], prompt_len: int, capacity: int) -> np.ndarray:
    """The positions the native selection keeps (sorted): the native twin of ``Method.select``."""
    lr = rule if isinstance(rule, LayerRule) else LayerRule(rule, cap=1, ratio=0.0)
    st = _struct(lr)
    pos, cls, allc = _i32(positions), _i32(classes), _i32(all_classes)
    sc = None if scores is None else np.ascontiguousarray(np.asarray(scores, dtype=np.float64))
    keep = np.zeros(max(1, len(pos)), dtype=np.uint8)
    _check(_fns().select(ctypes.byref(st), _iptr(pos), _iptr(cls),
                         None if sc is None else sc.ctypes.data_as(ctypes.POINTER(ctypes.c_double)),
                         len(pos), _iptr(allc), len(allc), prompt_len, capacity,
                         keep.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))), "pask_step_select")
    return np.sort(pos[keep[:len(pos)].astype(bool)].astype(np.int64))


class NativeStep(NativeHandle):
    """One request's native persistence step on a layered context (sequence ``seq_id``)."""

    def __init__(self, ctx, rules: Sequence[LayerRule], classes: Sequence[int], max_len: int, prompt_len: int,
                 probe=None, score_stat: int = -1, seq_id: int = 0) -> None:
        self._f = _fns()
        self.n_layer = len(rules)
        arr = (_Rule * self.n_layer)(*[_struct(r) for r in rules])
        cls = _i32(classes)
        probe_ptr = probe._ptr if probe is not None else None
        self._ptr = self._f.init(ctx.address, seq_id, arr, self.n_layer, _iptr(cls), len(cls), MAX_CLASSES, max_len,
                                 prompt_len, probe_ptr, score_stat)
        if not self._ptr:
            _check(-4, "pask_step_init")
        self._held = (ctypes.c_int32 * self.n_layer)()
        self._ev = np.zeros(4 * 4096, dtype=np.int32)

    def set_priority(self, priority: Sequence[float] | np.ndarray) -> None:
        """The priority of every prompt position for the ``tool-relevance`` order (higher persists
        first; one value per prompt position, generated positions rank span-head)."""
        pr = np.ascontiguousarray(np.asarray(priority, dtype=np.float64))
        _check(self._f.set_priority(self._ptr, pr.ctypes.data_as(ctypes.POINTER(ctypes.c_double)), len(pr)),
               "pask_step_set_priority")

    def set_scores(self, layer: int, scores: Sequence[float] | np.ndarray) -> None:
        """Layer ``layer``'s score of each position from 0 (the rest 0), ranked by its ``topk`` rule:
        a scored method's scores, taken once before the prefill."""
        s = np.ascontiguousarray(np.asarray(scores, dtype=np.float64))
        _check(self._f.set_scores(self._ptr, layer, s.ctypes.data_as(ctypes.POINTER(ctypes.c_double)), len(s)),
               "pask_step_set_scores")

    def set_trace(self, on: bool) -> None:
        self._f.set_trace(self._ptr, int(on))

    def collect(self, what: int) -> None:
        _check(self._f.collect(self._ptr, what), "pask_step_collect")

    def evict_to(self, layer: int, capacity: int, step: int, rule: str) -> int:
        return _check(self._f.evict_to(self._ptr, layer, capacity, step, RULE_CODES[rule]), "pask_step_evict_to")

    def drop_window(self, now: int, step: int) -> int:
        return _check(self._f.drop_window(self._ptr, now, step), "pask_step_drop_window")

    def token(self, cls: int, pos: int, n_gen: int) -> list[int]:
        """After decoding generated token ``n_gen`` (class ``cls``, at ``pos``): entries held per layer."""
        _check(self._f.token(self._ptr, cls, pos, n_gen, self._held), "pask_step_token")
        return list(self._held)

    def compact(self) -> int:
        """Move every layer's held cells to its lowest indices (n_kv then spans only them); cells moved."""
        return _check(self._f.compact(self._ptr), "pask_step_compact")

    def events(self) -> list[tuple[int, int, int, str]]:
        """Evictions since the last call: (step, layer, position, rule), in the order they ran."""
        out: list[tuple[int, int, int, str]] = []
        while True:
            n = _check(self._f.take_events(self._ptr, _iptr(self._ev), len(self._ev) // 4), "pask_step_take_events")
            ev = self._ev[:4 * n].reshape(-1, 4)
            out.extend((int(s), int(la), int(p), RULE_NAMES[int(r)]) for s, la, p, r in ev)
            if n < len(self._ev) // 4:
                return out

    def _release(self, ptr) -> None:
        self._f.free(ptr)
