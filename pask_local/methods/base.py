"""The KV-persistence method interface: each method is a small class with one selection rule.

The engine owns the cache and the bookkeeping; a method only answers two questions for one layer:
which of the held positions to keep when the layer must shrink to ``capacity`` (``select``), and
what each layer's capacity is for a given budget (``capacities``). Positions are token positions;
``LayerView`` carries everything a rule may look at.

A method object holds configuration only and may serve many requests at once: ``bind`` returns the
one request's ``MethodPlan`` (a frozen dataclass: capacities, warnings, priorities and, for PASK, the
compiled class quotas), and the engine selects through the plan, never through state on the method.

What a method needs from the engine it declares in class attributes, so the engine never branches
on a method's name: ``prefill_mode`` (how the prompt is read: ``PrefillMode``) and independent
ones, ``needs_attention``, ``attention_stat``, ``scales_swa_capacity``, ``reads_prompt_text``,
``prompt_scorer`` and ``native_step``.
``keeps_all``, ``compress_after_prefill`` and ``plans_prompt`` are read-only views of ``prefill_mode``
(kept for readers such as the slot pool). A baseline's ``name`` is set by the registry.
``step_rule`` describes the same selection as data (``StepRule``) for the native persistence step
(patch 0006), which runs it once per generated token without Python; ``select`` stays the reference.
Every method and PASK variant is registered once in ``methods.registry``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np


@dataclass
class LayerView:
    layer: int
    n_layer: int
    positions: np.ndarray            # int64 [n] positions held in this layer (any order)
    classes: np.ndarray              # int64 [n] StructuralClass index of each held position
    scores: np.ndarray | None = None  # float64 [n] method-specific attention statistic, if any
    prompt_len: int = 0              # tokens in the prompt (positions < prompt_len are prompt)
    all_classes: np.ndarray | None = None  # int64 [now+1] class index of every position so far


@dataclass(frozen=True)
class StepRule:
    """One layer's selection rule as data, for the native step (``pask-step.h``, struct pask_step_rule).

    ``kind``: ``quota`` (PASK: per-class shares ``keep``, ``never`` classes, ``recent`` newest (at
    least every generated position and every position >= ``protect_from``, PASK's held prompt tail),
    within-class ``order``, protection ``rank``), ``topk`` (the highest-scored positions, scores
    average-pooled by ``pool_kernel``; protected first: the ``protect_newest`` + floor(capacity x
    ``protect_ratio``) newest and every position >= ``protect_from``) or ``sink_recent``
    (``n_sink`` first positions + the newest).
    """

    kind: str
    protect_newest: int = 0
    protect_ratio: float = 0.0
    protect_from: int = -1
    pool_kernel: int = 1
    n_sink: int = 0
    recent: int = 0
    never: tuple[int, ...] = ()
    order: str = "oldest-first"
    keep: tuple[float, ...] = field(default=())   # per class index
    rank: tuple[int, ...] = field(default=())     # per class index


class PrefillMode(StrEnum):
    """How a method reads the prompt (what the engine's prefill does for it)."""

    NONE = "none"                                  # nothing is ever evicted (Full KV: the upstream cache)
    EVICT_WHILE_READING = "evict_while_reading"    # after each chunk, each layer shrinks to its capacity
    PLANNED = "planned"                            # the kept prompt positions are decided before prefill
                                                   # (select on the whole prompt, no scores); the rest is
                                                   # evicted between chunks
    WHOLE_THEN_COMPRESS = "whole_then_compress"    # the prompt is prefilled whole, then compressed once
                                                   # (a pool slot must hold the whole prompt)


@dataclass(frozen=True, eq=False)
class MethodPlan:
    """A method bound to one request (``Method.bind``): immutable, so one method serves many requests.

    ``capacities``: KV cells each layer may hold for the prompt (before the engine's sliding-window
    scaling and slot clamping); ``warnings``: why the budget could not be met as asked;
    ``priority``: per prompt position, what the native step ranks by (order ``tool-relevance``)."""

    method: Method
    capacities: tuple[int, ...]
    warnings: tuple[str, ...] = ()
    priority: np.ndarray | None = None

    def select(self, view: LayerView, capacity: int) -> np.ndarray:
        """Positions (subset of view.positions) to keep, at most ``capacity`` of them."""
        return self.method.select(view, capacity)

    def step_rule(self, layer: int, n_layer: int, prompt_len: int) -> StepRule:
        """``select`` of layer ``layer`` as data for the native step (same keep set for the same view)."""
        return self.method.step_rule(layer, n_layer, prompt_len)

    @property
    def step_scores(self) -> tuple[np.ndarray, ...] | None:
        """Per layer, one score per prompt position that the native step's ``topk`` rule ranks by, set
        once (None: the step collects its own, or ranks without scores)."""
        return None


class Method:
    """Base class: a uniform capacity of ``budget`` x visible tokens in every layer.

    Subclasses set ``prefill_mode`` and, where it applies, the independent declarations below; an
    instance holds configuration only (per-request state goes in the ``MethodPlan`` of ``bind``)."""

    name = "base"
    prefill_mode = PrefillMode.EVICT_WHILE_READING
    # independent of prefill_mode: an attention method may evict while reading (H2O, TOVA) or
    # compress once (SnapKV), and a whole-prompt method may not read attention at all
    needs_attention = False          # True: the engine must collect attention statistics
    attention_stat = "sum"           # incremental statistic: "sum" (accumulated) or "last" (newest query)
    scales_swa_capacity = True       # True: the engine scales a sliding-window layer's capacity by its window
    reads_prompt_text = False        # True: ``bind`` gets the prompt's token texts (PASK's tool-relevance)
    prompt_scorer = ""               # a scoring pass run before prefill (``engine.prescore``); ``bind`` gets
                                     # its per-layer scores (``methods.scored``)
    native_step = True               # False: no native step rule; the engine evicts by ``select`` in Python

    @property
    def keeps_all(self) -> bool:
        """Nothing is ever evicted (``PrefillMode.NONE``)."""
        return self.prefill_mode == PrefillMode.NONE

    @property
    def compress_after_prefill(self) -> bool:
        """The prompt is prefilled whole, then compressed once (``PrefillMode.WHOLE_THEN_COMPRESS``)."""
        return self.prefill_mode == PrefillMode.WHOLE_THEN_COMPRESS

    @property
    def plans_prompt(self) -> bool:
        """``select`` runs on the whole prompt before prefill (``PrefillMode.PLANNED``)."""
        return self.prefill_mode == PrefillMode.PLANNED

    def report_groups(self, n_layer: int) -> list[list[int]]:
        """Layer groups that stats, traces and the TUI report by: 4 contiguous groups."""
        from ..policy import contiguous_groups

        return contiguous_groups(n_layer, 4)

    def policy_json(self) -> dict | None:
        """The policy this method runs, for the trace header (None: a fixed rule)."""
        return None

    def bind(self, budget: float, classes: np.ndarray, n_layer: int,
             pieces: list[str] | None = None) -> MethodPlan:
        """This method for one request: a prompt whose tokens have ``classes`` (their texts
        ``pieces``, given when ``reads_prompt_text``) at ``budget``. Reads nothing but its arguments
        and the method's configuration; writes nothing."""
        return MethodPlan(self, tuple(self.capacities(budget, classes, n_layer)))

    def layer_keep(self, budget: float, n_layer: int) -> list[float] | None:
        """Each layer's share of a prompt it keeps at ``budget``, known before any prompt, where the
        layers' shares differ (their mean the budget); None: every layer keeps the budget. A pool
        sizes a slot's layers by it (``engine.pool.slot_capacities``)."""
        return None

    def capacities(self, budget: float, classes: np.ndarray, n_layer: int) -> list[int]:
        """KV cells each layer may hold for a sequence whose tokens have these classes."""
        cap = max(1, math.ceil(budget * len(classes)))
        return [cap] * n_layer

    def select(self, view: LayerView, capacity: int) -> np.ndarray:
        """Positions (subset of view.positions) to keep, at most ``capacity`` of them (a rule that
        needs per-request state selects through its plan instead)."""
        raise NotImplementedError

    def step_rule(self, layer: int, n_layer: int, prompt_len: int) -> StepRule:
        """``select`` of layer ``layer`` as data for the native step (same keep set for the same view)."""
        raise NotImplementedError(f"{self.name} has no native step rule")


def top_k_positions(positions: np.ndarray, scores: np.ndarray, k: int, protect: np.ndarray | None = None
                    ) -> np.ndarray:
    """The k positions with the highest scores (ties: newer first); ``protect`` ones kept first
    (if they alone exceed k, the newest k of them)."""
    k = max(0, min(k, len(positions)))
    if protect is None:
        protect = np.zeros(len(positions), dtype=bool)
    forced = np.sort(positions[protect])[max(0, int(protect.sum()) - k):]
    rest = ~protect
    room = max(0, k - len(forced))
    order = np.lexsort((-positions[rest], -scores[rest]))
    return np.sort(np.concatenate([forced, positions[rest][order[:room]]]))
