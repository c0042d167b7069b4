"""The two calibration signals of one teacher-forcing case, per (layer group, structural class).

For a case (prompt + gold continuation, one class per token) and a partition of the layers into
groups, evicting class ``c`` in group ``g`` means: in every layer of ``g`` only, the tokens of class
``c`` are removed from the KV cache the way the engine removes them:

- a prompt key ``j`` is invisible to every query of a later prefill chunk (chunks of ``chunk``
  tokens from position 0; the engine evicts between chunks, so queries of ``j``'s own chunk still
  see it) and to every continuation query;
- a generated key ``j`` (position >= n_prompt) is invisible to every later continuation query (the
  engine evicts after decoding it).

Signals (teacher forcing: the rows predicting continuation tokens are n_prompt-1 .. T-2):

1. ``dnll``: the gold continuation's mean negative log-likelihood (nats per token) with the
   eviction minus without it (task-error sensitivity);
2. ``distortion``: ||o' - o||_F / ||o||_F of group ``g``'s attention outputs (its layers, the
   prediction rows), divided by the number of evicted tokens (distortion per evicted token).

3. ``joint`` (per class, no group): the same two signals when the class is evicted in *every*
   layer at once: whether a class must persist at all. Single-group evictions can miss it when
   groups back each other up. On the embedded Gemma 3 270M (24 calib cases, shipped policy's
   provenance) that is the case for the call being written (``gen_struct``: 2.96 nats/token
   jointly vs 0.81 summed over single groups), not for prompt classes, whose cost sits in one
   group (query: 0.475 jointly vs 0.540 summed, 0.441 of it in layers 9-13).

Cost: one unmasked ``trace``; each cell restarts from the first layer of its group and from the
first row the eviction can change (``first_affected_row``), since earlier layers and rows are
unchanged (``ReferenceModel.forward_from``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pask_local.classes import StructuralClass

from .cases import TFCase
from .reference import ForwardTrace, ReferenceModel

DEFAULT_CHUNK = 64


def eviction_allowed(T: int, n_prompt: int, evicted: np.ndarray, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """[T, T] bool: query i may attend key j in a layer where the ``evicted`` positions are evicted."""
    evicted = np.asarray(evicted, dtype=bool)
    if evicted.shape != (T,):
        raise ValueError(f"evicted must have shape [{T}], got {evicted.shape}")
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    allowed = torch.ones(T, T, dtype=torch.bool)
    rows = torch.arange(T)
    big = torch.iinfo(torch.long).max
    row_chunk = torch.where(rows < n_prompt, rows // chunk, big)      # continuation rows: "after" all
    idx = torch.from_numpy(np.flatnonzero(evicted))
    prompt_j, gen_j = idx[idx < n_prompt], idx[idx >= n_prompt]
    if len(prompt_j):
        allowed[:, prompt_j] = ~(row_chunk[:, None] > (prompt_j // chunk)[None, :])
    if len(gen_j):
        allowed[:, gen_j] = ~(rows[:, None] > gen_j[None, :])
    return allowed


def first_affected_row(T: int, n_prompt: int, evicted: np.ndarray, chunk: int = DEFAULT_CHUNK) -> int:
    """The first query row that loses a key (T when none): every earlier row is unchanged."""
    first = T
    for j in np.flatnonzero(np.asarray(evicted, dtype=bool)):
        j = int(j)
        row = min((j // chunk + 1) * chunk, n_prompt) if j < n_prompt else j + 1
        first = min(first, row)
    return first


def layer_mask(n_layer: int, layers: Iterable[int], allowed: torch.Tensor) -> torch.Tensor:
    """[n_layer, T, T]: ``allowed`` in ``layers``, everything allowed elsewhere."""
    T = allowed.shape[0]
    mask = torch.ones(n_layer, T, T, dtype=torch.bool)
    for il in layers:
        mask[il] = allowed
    return mask


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (float64) of ``targets`` [R] under ``logits`` [R, V]."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    return -lp.gather(1, targets.view(-1, 1).to(lp.device)).squeeze(1)


@dataclass
class Baseline:
    """The unmasked forward of a case and what every cell is compared with."""

    case: TFCase
    trace: ForwardTrace
    rows: torch.Tensor            # prediction rows n_prompt-1 .. T-2
    targets: torch.Tensor         # the continuation tokens they predict
    nll: torch.Tensor             # per prediction row (float64)

    @property
    def mean_nll(self) -> float:
        return float(self.nll.mean())


def baseline(ref: ReferenceModel, case: TFCase) -> Baseline:
    T = len(case.tokens)
    rows = torch.arange(case.n_prompt - 1, T - 1)
    ids = torch.tensor(case.tokens, dtype=torch.long)
    tr = ref.trace(ids, logits_rows=rows)
    targets = ids[case.n_prompt:]
    return Baseline(case=case, trace=tr, rows=rows, targets=targets, nll=token_nll(tr.logits, targets))


@dataclass
class CellSignal:
    dnll: float                   # mean NLL increase of the gold continuation (nats / token)
    distortion: float             # relative attention-output change of the group, per evicted token
    rel_change: float             # the same before dividing by the number of evicted tokens
    n_evicted: int


def evict_signal(ref: ReferenceModel, base: Baseline, evicted: np.ndarray, layers: Sequence[int],
                 chunk: int = DEFAULT_CHUNK) -> CellSignal:
    """Both signals for evicting the ``evicted`` positions in ``layers`` (see module docstring)."""
    case = base.case
    T = len(case.tokens)
    layers = sorted(set(int(x) for x in layers))
    n_ev = int(np.asarray(evicted, dtype=bool).sum())
    if not layers or n_ev == 0:
        return CellSignal(0.0, 0.0, 0.0, n_ev)
    start = first_affected_row(T, case.n_prompt, evicted, chunk)
    ref_attn = torch.stack([base.trace.attn[il][base.rows] for il in layers])
    if start > int(base.rows[-1]):          # no prediction row loses a key
        return CellSignal(0.0, 0.0, 0.0, n_ev)
    mask = layer_mask(ref.n_layer, layers, eviction_allowed(T, case.n_prompt, evicted, chunk))
    sel = base.rows >= start
    logits, attn = ref.forward_from(layers[0], base.trace, mask, start_row=start,
                                    logits_rows=base.rows[sel], return_attn_outputs=True)
    nll = base.nll.clone()
    nll[sel] = token_nll(logits, base.targets[sel])
    new_attn = ref_attn.clone()
    new_attn[:, sel] = torch.stack([attn[il - layers[0]][base.rows[sel] - start] for il in layers])
    denom = float(ref_attn.double().norm())
    rel = float((new_attn.double() - ref_attn.double()).norm()) / denom if denom > 0 else 0.0
    return CellSignal(float(nll.mean() - base.nll.mean()), rel / n_ev, rel, n_ev)


@dataclass
class CaseSignals:
    """Per-case measurements, as stored one JSON line per case in the calibration cache."""

    id: str
    category: str
    n_prompt: int
    n_cont: int
    base_nll: float
    counts: dict[str, int]
    cells: list[dict] = field(default_factory=list)   # {"group", "class", "dnll", "distortion", ...}
    joint: list[dict] = field(default_factory=list)   # {"class", "dnll", ...}: evicted in every layer

    def to_json(self) -> dict:
        return {"id": self.id, "category": self.category, "n_prompt": self.n_prompt, "n_cont": self.n_cont,
                "base_nll": self.base_nll, "counts": self.counts, "cells": self.cells, "joint": self.joint}


def measure_case(ref: ReferenceModel, case: TFCase, groups: Sequence[Sequence[int]],
                 chunk: int = DEFAULT_CHUNK, skip: Iterable[StructuralClass] = (StructuralClass.SINK,),
                 on_cell=None) -> CaseSignals:
    """Both signals for every (group, class present in the case); ``skip``: classes never evicted."""
    base = baseline(ref, case)
    cls = np.array([c.value for c in case.classes])
    counts = {c.value: int((cls == c.value).sum()) for c in StructuralClass if (cls == c.value).any()}
    out = CaseSignals(id=case.id, category=case.category, n_prompt=case.n_prompt, n_cont=case.n_cont,
                      base_nll=base.mean_nll, counts=counts)
    skipped = {c.value for c in skip}
    for g, layers in enumerate(groups):
        for c in StructuralClass:
            if c.value not in counts or c.value in skipped:
                continue
            s = evict_signal(ref, base, cls == c.value, layers, chunk)
            out.cells.append({"group": g, "class": c.value, "dnll": s.dnll, "distortion": s.distortion,
                              "rel_change": s.rel_change, "n_evicted": s.n_evicted})
            if on_cell is not None:
                on_cell()
    out.joint = measure_joint(ref, case, chunk, skip, on_cell, base)
    return out


def measure_joint(ref: ReferenceModel, case: TFCase, chunk: int = DEFAULT_CHUNK,
                  skip: Iterable[StructuralClass] = (StructuralClass.SINK,), on_cell=None,
                  base: Baseline | None = None) -> list[dict]:
    """Both signals for evicting each class present in ``case`` in every layer at once."""
    base = base or baseline(ref, case)
    cls = np.array([c.value for c in case.classes])
    skipped = {c.value for c in skip}
    out = []
    for c in StructuralClass:
        if c.value in skipped or not (cls == c.value).any():
            continue
        s = evict_signal(ref, base, cls == c.value, range(ref.n_layer), chunk)
        out.append({"class": c.value, "dnll": s.dnll, "distortion": s.distortion, "rel_change": s.rel_change,
                    "n_evicted": s.n_evicted})
        if on_cell is not None:
            on_cell()
    return out


def n_joint_cells(case: TFCase, skip: Iterable[StructuralClass] = (StructuralClass.SINK,)) -> int:
    """How many cells ``measure_joint`` evaluates for ``case``: one per class present."""
    return len(set(case.classes) - set(skip))


def n_cells(case: TFCase, n_groups: int, skip: Iterable[StructuralClass] = (StructuralClass.SINK,)) -> int:
    """How many cells ``measure_case`` evaluates for ``case`` (for progress bars): one per
    (group, class) plus one joint cell per class."""
    return n_joint_cells(case, skip) * (n_groups + 1)
