"""The task-error signal measured by llama.cpp itself: one prefill per case, every cell a cheap fork.

``signals.py`` measures each (layer group, class) cell with the torch reference, where a cell costs
a forward from its group's first layer. Here the deployed engine measures it: the case's prompt is
prefilled once, whole, in sequence 0 of a layered context with one KV stream (``kv_unified``); for
each cell, sequence 1 gets the same cells (``llama_memory_seq_cp``: a cell carries both ids, no
copy), the cell's prompt positions are dropped from sequence 1 in the cell's layers only
(``LayeredContext.evict``), and the gold continuation is decoded in sequence 1 in one batch with
logits on every row; then sequence 1 is dropped. A cell costs one batch of the continuation's
length (tens of tokens) instead of a forward over the prompt.

What an eviction means here is what a method that compresses after reading the whole prompt does
(SnapKV, PyramidKV, pask-hybrid): every prompt query saw the key, the continuation does not. It is
the torch signal with one prefill chunk as long as the prompt (``signals.eviction_allowed`` with
``chunk >= n_prompt``), which ``tests/test_calibration_native_signals.py`` checks it against.
Generated classes are not measured (the engine keeps the call being written whatever the policy).

``keep`` (budget-aware signal): instead of the whole class, each of its spans (maximal runs of
the class) loses its tail and keeps its first ``ceil(keep x length)`` tokens, as the span-head
order evicts within a class, so a class is measured at the share a budget leaves it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pask_local.classes import StructuralClass
from pask_local.errors import NativeError, PaskError
from pask_local.kv_layered import LayeredContext
from pask_local.llm import ContextConfig, Model

from .cases import TFCase

PREFILL_BATCH = 512


def span_tail_positions(classes: Sequence[StructuralClass], cls: StructuralClass, n_prompt: int,
                        keep: float = 0.0) -> list[int]:
    """Prompt positions of ``cls`` to evict: of each maximal run of it, all but its first
    ``ceil(keep x run length)`` tokens (``keep`` 0: the whole class)."""
    if not 0.0 <= keep <= 1.0:
        raise PaskError(f"keep must be in [0, 1], got {keep}")
    out: list[int] = []
    i = 0
    while i < n_prompt:
        if classes[i] != cls:
            i += 1
            continue
        j = i
        while j < n_prompt and classes[j] == cls:
            j += 1
        out += range(i + math.ceil(keep * (j - i)), j)
        i = j
    return out


def _nll(logits: np.ndarray, target: int) -> float:
    x = logits.astype(np.float64)
    m = float(x.max())
    return m + math.log(float(np.exp(x - m).sum())) - float(x[target])


@dataclass
class NativeCase:
    """One case prefilled in a layered context, ready to measure evictions (close it when done)."""

    model: Model
    case: TFCase
    ctx: LayeredContext
    first_nll: float        # NLL of the continuation's first token (from the prefill: no eviction reaches it)
    base_nll: float         # mean NLL of the continuation without eviction

    @classmethod
    def open(cls, model: Model, case: TFCase) -> NativeCase:
        n, cont = case.n_prompt, case.tokens[case.n_prompt:]
        cells = n + len(cont) + 1
        cfg = ContextConfig(n_ctx=cells, n_batch=max(PREFILL_BATCH, len(cont)), n_seq_max=2, kv_unified=True)
        ctx = LayeredContext(model, [cells] * model.n_layer, cfg, unified=True)
        try:
            if ctx.decode(case.tokens[:n], 0, seq_id=0, logits="last") != 0:
                raise NativeError(f"case {case.id}: llama_decode failed on the prompt")
            first = _nll(ctx.logits(), cont[0])
            out = cls(model, case, ctx, first, 0.0)
            out.base_nll = out.continuation_nll({})
            return out
        except BaseException:
            ctx.close()
            raise

    def continuation_nll(self, evicted: dict[int, Sequence[int]]) -> float:
        """Mean NLL (nats per gold token) with ``evicted[layer]`` prompt positions dropped in those layers."""
        case, ctx = self.case, self.ctx
        n, cont = case.n_prompt, case.tokens[case.n_prompt:]
        if len(cont) == 1:
            return self.first_nll
        ctx.seq_cp(0, 1)
        try:
            for layer, positions in evicted.items():
                if len(positions):
                    ctx.evict(layer, positions, seq_id=1)
            rows = cont[:-1]
            if ctx.decode_batch(rows, list(range(n, n + len(rows))), [1] * len(rows), [True] * len(rows)) != 0:
                raise NativeError(f"case {case.id}: llama_decode failed on the continuation")
            total = self.first_nll + sum(_nll(ctx.logits(i), cont[i + 1]) for i in range(len(rows)))
            return total / len(cont)
        finally:
            ctx.seq_rm(1, -1, -1)

    def dnll(self, positions: Sequence[int], layers: Iterable[int]) -> float:
        """NLL increase for evicting prompt ``positions`` in ``layers``."""
        if not len(positions):
            return 0.0
        return self.continuation_nll({il: positions for il in layers}) - self.base_nll

    def close(self) -> None:
        self.ctx.close()


def measure_case_native(model: Model, case: TFCase, groups: Sequence[Sequence[int]], keep: float = 0.0,
                        skip: Iterable[StructuralClass] = (StructuralClass.SINK,), on_cell=None) -> dict:
    """Per (group, prompt class) and jointly (every layer) the NLL increase of evicting the class
    (down to ``keep`` of each span); one JSON-able record like ``signals.CaseSignals.to_json``,
    without the attention-output distortion (None: llama.cpp does not expose it here)."""
    present = measured_classes(case, skip)
    counts = {c.value: sum(1 for x in case.classes if x == c) for c in StructuralClass if c in case.classes}
    nc = NativeCase.open(model, case)
    try:
        rec = {"id": case.id, "category": case.category, "n_prompt": case.n_prompt, "n_cont": case.n_cont,
               "base_nll": nc.base_nll, "counts": counts, "signal": "native", "keep": keep,
               "cells": [], "joint": []}
        for c in present:
            pos = span_tail_positions(case.classes, c, case.n_prompt, keep)
            for g, layers in enumerate(groups):
                rec["cells"].append({"group": g, "class": c.value, "dnll": nc.dnll(pos, layers),
                                     "distortion": None, "n_evicted": len(pos)})
                if on_cell is not None:
                    on_cell()
            rec["joint"].append({"class": c.value, "dnll": nc.dnll(pos, range(model.n_layer)),
                                 "distortion": None, "n_evicted": len(pos)})
            if on_cell is not None:
                on_cell()
        return rec
    finally:
        nc.close()


def measured_classes(case: TFCase, skip: Iterable[StructuralClass] = (StructuralClass.SINK,)) -> list[StructuralClass]:
    """The prompt classes ``measure_case_native`` measures for ``case`` (generated ones never), in enum order."""
    skipped, here = set(skip), set(case.classes[:case.n_prompt])
    return [c for c in StructuralClass if c in here and not c.is_generated and c not in skipped]


def n_native_cells(case: TFCase, n_groups: int, skip: Iterable[StructuralClass] = (StructuralClass.SINK,)) -> int:
    """How many cells ``measure_case_native`` measures for ``case`` (for progress bars)."""
    return len(measured_classes(case, skip)) * (n_groups + 1)


# The shares of the prompt at which each layer group's budget curve is measured (policy/groups.py)
GROUP_LEVELS = (0.05, 0.1, 0.2, 0.35, 0.5)


def group_keep_positions(model: Model, case: TFCase, groups: Sequence[Sequence[int]], share: float) -> list[np.ndarray]:
    """Per group: the prompt positions the hand-written prior keeps in that group's layers when each
    layer may hold ``share`` of the prompt (its class quotas, span-head order, sinks and the held
    tail: ``methods.pask.PASKPlan.select`` on the whole prompt, as a structural plan decides before prefill)."""
    from pask_local.methods import LayerView
    from pask_local.methods.pask import PASK, class_indices
    from pask_local.policy.handwritten import handwritten_policy

    n = case.n_prompt
    cls = class_indices(case.classes[:n])
    method = PASK(handwritten_policy(model.n_layer, len(groups)))
    plan = method.bind(share, cls, model.n_layer)  # compiles the class quotas select reads
    out = []
    for layers in groups:
        il = layers[0]
        view = LayerView(layer=il, n_layer=model.n_layer, positions=np.arange(n), classes=cls, prompt_len=n,
                         all_classes=cls)
        out.append(np.asarray(plan.select(view, max(1, math.ceil(share * n))), dtype=np.int64))
    return out


def measure_group_curves(model: Model, case: TFCase, groups: Sequence[Sequence[int]],
                         levels: Sequence[float] = GROUP_LEVELS, on_cell=None) -> list[dict]:
    """Per (group, level): the NLL increase when that group's layers keep only ``level`` of the prompt
    (``group_keep_positions``) and every other layer keeps it all; JSON-able cells."""
    nc = NativeCase.open(model, case)
    try:
        cells = []
        everything = np.arange(case.n_prompt)
        for k in levels:
            kept = group_keep_positions(model, case, groups, k)
            for g, layers in enumerate(groups):
                drop = np.setdiff1d(everything, kept[g]).tolist()
                cells.append({"group": g, "keep": k, "dnll": nc.dnll(drop, layers), "n_kept": int(len(kept[g]))})
                if on_cell is not None:
                    on_cell()
        return cells
    finally:
        nc.close()
