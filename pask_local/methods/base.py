"""The KV-persistence method interface: each method is a small class with one selection rule.

The engine owns the cache and the bookkeeping; a method only answers two questions for one layer:
which of the held positions to keep when the layer must shrink to ``capacity`` (``select``), and
what each layer's capacity is for a given budget (``capacities``). Positions are token positions;
``LayerView`` carries everything a rule may look at. What a method needs from the engine it declares
in class attributes (``keeps_all``, ``needs_attention``, ``attention_stat``, ``compress_after_prefill``,
``plans_prompt``, ``scales_swa_capacity``, ``reads_prompt_text``), so the engine never branches on a
method's name.
``step_rule`` describes the same selection as data (``StepRule``) for the native persistence step
(patch 0006), which runs it once per generated token without Python; ``select`` stays the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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


class Method:
    """Base class: a uniform capacity of ``budget`` x visible tokens in every layer."""

    name = "base"
    keeps_all = False                # True: nothing is ever evicted (the upstream cache, Full KV)
    needs_attention = False          # True: the engine must collect attention statistics
    attention_stat = "sum"           # incremental statistic: "sum" (accumulated) or "last" (newest query)
    compress_after_prefill = False   # True: the prompt is prefilled whole, then compressed once
    plans_prompt = False             # True: select() on the whole prompt before prefill (no scores needed)
    scales_swa_capacity = True       # True: the engine scales a sliding-window layer's capacity by its window
    reads_prompt_text = False        # True: the engine passes the prompt's token texts (observe_prompt)

    def report_groups(self, n_layer: int) -> list[list[int]]:
        """Layer groups that stats, traces and the TUI report by: 4 contiguous groups."""
        from ..policy import contiguous_groups

        return contiguous_groups(n_layer, 4)

    def policy_json(self) -> dict | None:
        """The policy this method runs, for the trace header (None: a fixed rule)."""
        return None

    def budget_warnings(self) -> list[str]:
        """Why the last ``capacities`` call could not meet the budget (empty: it did)."""
        return []

    def observe_prompt(self, pieces: list[str], classes: np.ndarray) -> None:
        """The prompt's token texts and classes, before ``capacities`` (only if ``reads_prompt_text``)."""

    def step_priority(self) -> np.ndarray | None:
        """Per-position priorities the native step ranks by (rules with order ``tool-relevance``), or None."""
        return None

    def capacities(self, budget: float, classes: np.ndarray, n_layer: int) -> list[int]:
        """KV cells each layer may hold for a sequence whose tokens have these classes."""
        cap = max(1, math.ceil(budget * len(classes)))
        return [cap] * n_layer

    def select(self, view: LayerView, capacity: int) -> np.ndarray:
        """Positions (subset of view.positions) to keep, at most ``capacity`` of them."""
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
