"""PASK: keep, per layer group, each structural class's share given by a compiled policy.

The ``recent`` newest positions, every generated token (the call being written) and the prompt's
tail (``hold_tail``: of its last ``recent`` tokens, the final run of query and template tokens, i.e.
the question and the assistant's header, which SnapKV's observation window also holds) are kept
first, capacity permitting: decode-time evictions come from the rest of the prompt. Among the rest, within a group g, class c
keeps ``ceil(keep[g][c] * n_c)`` of its ``n_c`` tokens so far (classes in the policy's
``never_evict`` keep all); within a class the policy's ``within_class_order`` says which go first:
``oldest-first``, ``newest-first``, or ``span-head`` (a span is a run of same-class tokens, e.g. one
tool's description: every span loses its tail before any span loses its head, so each tool keeps
the start of its description instead of the oldest tools losing theirs whole), or ``attention``
(the tokens that the prompt's last ``window`` queries attend to most persist first: SnapKV's pooled
observation-window statistic, used only to rank tokens inside a class whose share the policy fixed),
or ``tool-relevance`` (span-head, but the entries of the tools whose words the query shares persist
first, ``tagging.relevance``: a tool's description, parameter names and types outlast every
less relevant tool's; decided from the prompt's text before prefill, so it evicts while prefilling).
If rounding leaves the layer over capacity, the least protective classes (``PROTECTION_ORDER``) give
up tokens first, in the same order; if it leaves room, the most protective evicted tokens come back.

A policy with ``residual`` ``attention`` (the ``pask-hybrid`` variant): only its floors are class quotas; the
capacity left after them goes to the tokens the observation window attends to most, whatever their
class (every class without a floor shares one protection rank, so attention alone orders them).
Structure says what must persist (names, the query, the call); attention ranks everything else.
With the structural orders only this lookup runs online and the prompt is evicted while it is
prefilled; ``attention`` needs the statistic, so the prompt is prefilled whole and compressed once.
"""

from __future__ import annotations

import math

import numpy as np

from ..classes import PROTECTION_ORDER, StructuralClass, class_index
from ..policy import CompiledPolicy, Policy, compile_policy
from ..tagging.relevance import tool_relevance
from .base import LayerView, Method, StepRule
from .snapkv import pool_scores

_ALL = list(StructuralClass)
_RANK = np.array([PROTECTION_ORDER.index(c) for c in _ALL])  # class index -> protection rank
_TAIL = [class_index(StructuralClass.QUERY), class_index(StructuralClass.TEMPLATE)]  # a held prompt tail's classes


class PASK(Method):
    name = "pask"
    scales_swa_capacity = False  # the compile step already counts sliding-window layers by their window

    def __init__(self, policy: Policy, swa_layers: tuple[int, ...] = (), window: int = 0,
                 recent: int = 32, hold_tail: bool = True) -> None:
        self.policy = policy
        self.hold_tail = hold_tail  # the prompt's question-and-header tail stays held while the call is written
        self._prompt_classes: np.ndarray | None = None  # class index per prompt position (compile)
        self.ranks = [_RANK if policy.residual == "weights" else _floor_ranks(f) for f in policy.floors]
        self.recent = recent
        self.swa_layers = swa_layers
        self.window = window
        self.group_of = policy.group_of_layer()
        self.compiled: CompiledPolicy | None = None
        # ranking inside a class by attention needs the engine's observation-window statistic
        self.needs_attention = policy.within_class_order == "attention"
        self.compress_after_prefill = self.needs_attention
        self.plans_prompt = not self.needs_attention  # a structural order: decided before prefill
        self.reads_prompt_text = policy.within_class_order == "tool-relevance"
        self._priority: np.ndarray | None = None  # tool-relevance: per prompt position (observe_prompt)
        self.kernel = 7  # score pooling, as SnapKV

    def observe_prompt(self, pieces: list[str], classes: np.ndarray) -> None:
        if self.reads_prompt_text:
            self._priority = relevance_priority(tool_relevance(pieces, classes), np.asarray(classes))

    def step_priority(self) -> np.ndarray | None:
        return self._priority

    def compile(self, budget: float, classes: np.ndarray) -> CompiledPolicy:
        self._prompt_classes = np.asarray(classes, dtype=np.int64)
        counts = np.bincount(classes, minlength=len(_ALL))
        self.compiled = compile_policy(self.policy, budget, {c: int(counts[i]) for i, c in enumerate(_ALL)},
                                       self.swa_layers, self.window)
        if self.policy.residual == "attention":  # the floors are the only quotas; attention fills the rest
            self.compiled.keep = [dict(f) for f in self.policy.floors]
        return self.compiled

    def report_groups(self, n_layer: int) -> list[list[int]]:
        return self.policy.groups

    def policy_json(self) -> dict:
        return self.policy.to_json()

    def budget_warnings(self) -> list[str]:
        return list(self.compiled.warnings) if self.compiled is not None else []

    def capacities(self, budget: float, classes: np.ndarray, n_layer: int) -> list[int]:
        self.policy.check_model(n_layer)
        return list(self.compile(budget, classes).layer_capacity)

    def select(self, view: LayerView, capacity: int) -> np.ndarray:
        if self.compiled is None:
            raise RuntimeError("PASK.select before capacities()/compile()")
        pos, cls = view.positions, view.classes
        if len(pos) <= capacity:
            return np.sort(pos)
        keep_frac = self.compiled.keep[self.group_of[view.layer]]
        rank = self.ranks[self.group_of[view.layer]]
        totals = np.bincount(view.all_classes if view.all_classes is not None else cls, minlength=len(_ALL))
        never = np.isin(cls, [class_index(c) for c in self.policy.never_evict])
        recent = never.copy()  # never-evict classes first, then the call being written, the tail, the newest
        n_gen = int((pos >= view.prompt_len).sum()) if view.prompt_len else 0
        tail_from = self.tail_from(view.prompt_len)
        n_tail = int((~never & (pos >= tail_from)).sum()) if tail_from >= 0 else 0
        n_recent = max(0, min(max(self.recent, n_gen, n_tail), capacity - int(never.sum())))
        if n_recent:
            others = np.flatnonzero(~never)
            recent[others[np.argsort(pos[others])[len(others) - n_recent:]]] = True
        kept = recent.copy()
        worth = self._worth(pos, view.all_classes, view.scores, view.prompt_len)  # higher persists first
        for ci in np.unique(cls):
            of_class = cls == ci
            members = np.flatnonzero(of_class & ~kept)
            c = _ALL[ci]
            target = int(of_class.sum()) if c in self.policy.never_evict else math.ceil(
                keep_frac[c] * totals[ci] - 1e-9)
            want = min(max(0, target - int((of_class & kept).sum())), len(members))
            if want:
                best = members[np.argsort(worth[members], kind="stable")[-want:]]
                kept[best] = True
        # rank: protection rank, then worth within the class
        if kept.sum() > capacity:
            idx = np.flatnonzero(kept & ~recent)
            order = np.lexsort((worth[idx], -rank[cls[idx]]))  # least protective, least worth first
            kept[idx[order[: kept.sum() - capacity]]] = False
        elif kept.sum() < capacity:
            idx = np.flatnonzero(~kept)
            order = np.lexsort((-worth[idx], rank[cls[idx]]))  # most protective, most worth first
            kept[idx[order[: capacity - kept.sum()]]] = True
        return np.sort(pos[kept])

    def step_rule(self, layer: int, n_layer: int, prompt_len: int) -> StepRule:
        if self.compiled is None:
            raise RuntimeError("PASK.step_rule before capacities()/compile()")
        group = self.group_of[layer]
        keep_frac = self.compiled.keep[group]
        return StepRule("quota", recent=self.recent, protect_from=self.tail_from(prompt_len),
                        never=tuple(class_index(c) for c in self.policy.never_evict),
                        order=self.policy.within_class_order,
                        keep=tuple(float(keep_frac[c]) for c in _ALL), rank=tuple(int(r) for r in self.ranks[group]))

    def tail_from(self, prompt_len: int) -> int:
        """The first position of the held prompt tail (-1: none): of the prompt's last ``recent``
        tokens, the final run of query and template tokens (the question and the assistant's header,
        which SnapKV's observation window also holds; not the end of a tool list)."""
        cls = self._prompt_classes
        if not self.hold_tail or prompt_len <= 0 or cls is None or len(cls) < prompt_len:
            return -1
        start = max(0, prompt_len - self.recent)
        other = np.flatnonzero(~np.isin(cls[start:prompt_len], _TAIL))
        first = start + (int(other[-1]) + 1 if len(other) else 0)
        return first if first < prompt_len else -1

    def _worth(self, pos: np.ndarray, all_classes: np.ndarray | None,
               scores: np.ndarray | None = None, prompt_len: int = 0) -> np.ndarray:
        """Within-class persistence order of ``pos`` (higher persists first; all values distinct)."""
        order = self.policy.within_class_order
        if order == "attention":
            if scores is None:
                raise RuntimeError("PASK with within_class_order 'attention' needs attention scores")
            pooled = pool_scores(pos, scores, self.kernel)
            return np.lexsort((pos, pooled)).argsort().astype(np.float64)  # rank; ties: newer first
        if order == "tool-relevance":  # prompt positions by priority, generated ones span-head
            pr = self._priority
            if pr is None or len(pr) < prompt_len or all_classes is None:
                raise RuntimeError("PASK with within_class_order 'tool-relevance' needs observe_prompt() first")
            head = _span_head(pos, all_classes)
            if prompt_len == 0:
                return head
            return np.where(pos < prompt_len, pr[np.minimum(pos, max(0, prompt_len - 1))], head)
        if order == "newest-first":
            return (-pos).astype(np.float64)
        if order == "span-head" and all_classes is not None and len(all_classes) > int(pos.max(initial=0)):
            return _span_head(pos, all_classes)
        return pos.astype(np.float64)


def _span_head(pos: np.ndarray, all_classes: np.ndarray) -> np.ndarray:
    """The span-head worth of ``pos``: a smaller offset in its span persists first; among equal
    offsets, the newer span."""
    return -span_offsets(all_classes)[pos].astype(np.float64) + pos / (pos.max(initial=0) + 1.0)


def relevance_priority(relevance: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """The ``tool-relevance`` order as one priority per prompt position (higher persists first, all
    distinct): its tool's relevance (in thousandths) first, then span-head (a smaller offset in its
    span first; among equal offsets the newer span)."""
    n = len(classes)
    rel = np.round(np.clip(np.asarray(relevance, dtype=np.float64), 0.0, 1.0) * 1000.0)
    return rel * 1e6 - span_offsets(np.asarray(classes, dtype=np.int64)) + np.arange(n) / (n + 1.0)


def _floor_ranks(floors: dict[StructuralClass, float]) -> np.ndarray:
    """Protection ranks when attention fills the residual: classes with a floor keep their
    ``PROTECTION_ORDER`` rank; every other class shares the one rank after them."""
    return np.array([_RANK[i] if floors.get(c, 0.0) > 0.0 else len(_ALL) for i, c in enumerate(_ALL)])


def span_offsets(classes: np.ndarray) -> np.ndarray:
    """For each position, its index inside its span (the run of equal classes it belongs to)."""
    n = len(classes)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    idx = np.arange(n)
    start = np.r_[True, classes[1:] != classes[:-1]]
    return idx - np.maximum.accumulate(np.where(start, idx, 0))


def class_indices(classes: list[StructuralClass]) -> np.ndarray:
    return np.array([class_index(c) for c in classes], dtype=np.int64)
