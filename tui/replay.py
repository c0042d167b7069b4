"""Replays a trace: which positions each layer / layer group holds after any step, and why they left.

State after step ``s`` (``s = -1``: after prefill) follows docs/trace-format.md: a layer holds every
position that exists by then (``pos < n_prompt + s + 1``) minus the positions it evicted at steps
``<= s``; a group holds a position when every one of its layers does. Pure numpy, no Textual.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pask_local.classes import StructuralClass, class_index

from .trace import Trace

_NEVER = np.iinfo(np.int32).max
CLASSES = list(StructuralClass)


@dataclass(frozen=True)
class Eviction:
    """A position that one or more layers of a group dropped at a step."""

    pos: int
    rules: tuple[str, ...]   # the rules of the layers that dropped it at this step
    layers: int              # how many layers of the group dropped it at this step
    left_group: bool         # True when the group no longer holds it in every layer


@dataclass(frozen=True)
class StepChanges:
    step: int
    added: int | None                  # position decoded at this step (None after prefill)
    evicted: list[Eviction]

    def rule_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.evicted:
            for r in set(e.rules):
                out[r] = out.get(r, 0) + 1
        return out


@dataclass(frozen=True)
class ClassStat:
    cls: StructuralClass
    kept: int     # held by every layer of the group
    partial: int  # held by some but not all layers of the group
    total: int    # positions of this class that exist at the step


class Replay:
    """Per-step views of one trace. Call ``refresh()`` after a live trace grew."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.refresh()

    def refresh(self) -> None:
        t = self.trace
        h = t.header
        self.n_layer = h.n_layer
        self.groups = h.groups
        self.n_pos = len(t.tokens)
        self.n_prompt = t.n_prompt
        self.classes = np.fromiter((class_index(tok.cls) for tok in t.tokens), dtype=np.int16, count=self.n_pos)
        self.evict_step = np.full((h.n_layer, self.n_pos), _NEVER, dtype=np.int32)
        self.evict_rule = np.full((h.n_layer, self.n_pos), -1, dtype=np.int16)
        self.rules: list[str] = []
        rule_id: dict[str, int] = {}
        for e in t.evicts:
            rid = rule_id.setdefault(e.rule, len(rule_id))
            if rid == len(self.rules):
                self.rules.append(e.rule)
            idx = np.asarray(e.positions, dtype=np.int64)
            self.evict_step[e.layer, idx] = e.step
            self.evict_rule[e.layer, idx] = rid
        self._pos = np.arange(self.n_pos)

    # ----------------------------------------------------------- the steps
    @property
    def first_step(self) -> int:
        return -1

    @property
    def last_step(self) -> int:
        """The last step with a step line (-1 when generation has not reached one)."""
        return len(self.trace.steps) - 1

    def clamp(self, step: int) -> int:
        return max(self.first_step, min(self.last_step, step))

    def n_seq(self, step: int) -> int:
        """Positions decoded into the cache after ``step``."""
        return min(self.n_pos, self.n_prompt + step + 1)

    def present(self, step: int) -> np.ndarray:
        return self._pos < self.n_seq(step)

    # ------------------------------------------------------------ holdings
    def layer_held(self, step: int) -> np.ndarray:
        """bool [n_layer, n_pos]: layer l holds position p after ``step``."""
        return self.present(step)[None, :] & (self.evict_step > step)

    def group_counts(self, step: int) -> np.ndarray:
        """int [n_groups, n_pos]: how many layers of each group hold each position."""
        held = self.layer_held(step)
        return np.stack([held[layers].sum(axis=0) for layers in self.groups])

    def group_held(self, step: int, group: int) -> np.ndarray:
        """bool [n_pos]: every layer of ``group`` holds the position."""
        return self.layer_held(step)[self.groups[group]].all(axis=0)

    def kept_per_group(self, step: int) -> list[int]:
        """KV entries held per group (sum over its layers): the trace's ``step.kept``."""
        held = self.layer_held(step)
        return [int(held[layers].sum()) for layers in self.groups]

    def retained(self, step: int) -> dict[int, list[int]]:
        """Positions held by every layer of each group: the trace's ``final.retained`` at the last step."""
        return {g: np.flatnonzero(self.group_held(step, g)).tolist() for g in range(len(self.groups))}

    def budget_used(self, step: int) -> float:
        """Entries held over the entries full KV would hold (sliding-window layers: their window)."""
        n = self.n_seq(step)
        h = self.trace.header
        full = sum(min(n, h.window) if (il in h.swa_layers and h.window > 0) else n for il in range(self.n_layer))
        return float(self.layer_held(step).sum()) / full if full else 1.0

    # ------------------------------------------------------------ changes
    def changes(self, step: int, group: int) -> StepChanges:
        """What ``step`` added and what the layers of ``group`` evicted at it (and by which rule)."""
        layers = self.groups[group]
        at = self.evict_step[layers] == step                     # [layers, n_pos]
        hit = np.flatnonzero(at.any(axis=0))
        still = self.group_held(step, group)
        evicted = []
        for p in hit.tolist():
            rows = np.flatnonzero(at[:, p])
            rules = tuple(sorted({self.rules[self.evict_rule[layers[r], p]] for r in rows}))
            evicted.append(Eviction(pos=p, rules=rules, layers=len(rows), left_group=not still[p]))
        added = self.n_prompt + step if step >= 0 and self.n_prompt + step < self.n_pos else None
        return StepChanges(step=step, added=added, evicted=evicted)

    def class_stats(self, step: int, group: int) -> list[ClassStat]:
        """Per class present in the trace: positions kept / partly kept / existing in ``group``."""
        counts = self.group_counts(step)[group]
        n_layers = len(self.groups[group])
        present = self.present(step)
        out = []
        for ci in np.unique(self.classes).tolist():
            mask = (self.classes == ci) & present
            out.append(ClassStat(cls=CLASSES[ci], kept=int((counts[mask] == n_layers).sum()),
                                 partial=int(((counts[mask] > 0) & (counts[mask] < n_layers)).sum()),
                                 total=int(mask.sum())))
        return out

    def policy_row(self, group: int, cls: StructuralClass) -> tuple[float | None, float | None]:
        """(floor, weight) of ``cls`` in ``group`` from the header's policy (None for baselines)."""
        pol = self.trace.header.policy
        if not pol:
            return None, None
        return _policy_value(pol.get("floors"), group, cls), _policy_value(pol.get("weights"), group, cls)


def _policy_value(table, group: int, cls: StructuralClass) -> float | None:
    """Reads per-group tables stored as a list (policy file) or as an object keyed by group."""
    row = None
    if isinstance(table, list) and group < len(table):
        row = table[group]
    elif isinstance(table, dict):
        row = table.get(str(group))
    if isinstance(row, dict) and isinstance(row.get(cls.value), int | float):
        return float(row[cls.value])
    return None
