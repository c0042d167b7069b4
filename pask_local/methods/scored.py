"""Query-agnostic methods that rank the prompt by a score taken before the question is read.

Each declares ``prompt_scorer``: the name of a scoring pass (``engine.prescore``) that the engine
runs on the prompt in a context of its own before the request's prefill, giving per layer one score
per prompt position. The kept prompt positions are then decided before prefill (``PLANNED``): per
layer, the ``n_sink`` first positions and everything from ``obs_start`` on (the question, the
assistant's header, what is generated) first, then the highest-scored rest. Because the scoring
pass reads only the part before the user's first turn (``obs_end``), two questions behind the same
catalog keep the same catalog positions: the method can compress a prefix once (``pask-local
compress``).

- ``SnapKVPrefix``: SnapKV with its observation window taken from the prefix's own tail (the
  ``window`` tokens before the user's turn), average-pooled scores (``kernel``).
- ``KVzipStyle``: the prefix is re-presented after a "repeat the context" instruction and each entry is
  scored by the attention the repetition's queries pay it (summed over queries and heads: a
  layer-level, sum-pooled reading of KVzip's reconstruction score).
- ``KNorm``: score-free: the keys of lowest L2 norm persist (averaged over a layer's KV heads).
- ``KeyDiff``: score-free: the keys least similar (cosine) to their head's mean key direction over
  the prefix persist (averaged over a layer's KV heads): distinct keys over typical ones.

A request that starts from a restored (already compressed) prefix runs no scoring pass: the engine
scores what the stream holds 1 and the rest 0, so the prefix's kept entries rank first (the oldest
go first when the request's own budget must cut more). Without any scores the oldest go first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..classes import StructuralClass, class_index
from .base import LayerView, Method, MethodPlan, PrefillMode, StepRule, top_k_positions
from .snapkv import pool_scores

_QUERY = class_index(StructuralClass.QUERY)
_TOOL_RESULT = class_index(StructuralClass.TOOL_RESULT)


def prefix_end(classes: np.ndarray) -> int:
    """Where the part every request shares ends: the first position of the user's (or a tool's)
    text, else the prompt's length."""
    hit = np.flatnonzero(np.isin(np.asarray(classes), (_QUERY, _TOOL_RESULT)))
    return int(hit[0]) if len(hit) else len(classes)


@dataclass(frozen=True, eq=False)
class ScoredPlan(MethodPlan):
    """A scored method bound to one prompt: per layer the score of every prompt position (None: no
    scoring pass ran), and where the protected tail starts."""

    scores: tuple[np.ndarray, ...] | None = None
    obs_start: int = 0
    pooled: bool = True  # False: the scores mark what a restored prefix holds (no smoothing)

    def select(self, view: LayerView, capacity: int) -> np.ndarray:
        m: ScoredMethod = self.method  # type: ignore[assignment]
        pos = view.positions
        if len(pos) <= capacity:
            return np.sort(pos)
        protect = (pos < m.n_sink) | (pos >= self.obs_start)
        if self.scores is None:  # no scores: oldest first goes
            worth = pos.astype(np.float64)
        else:  # pooled along every held position; one past the scored ones scores 0
            layer = self.scores[view.layer]
            inside = pos < len(layer)
            raw = np.zeros(len(pos))
            raw[inside] = layer[pos[inside]]
            worth = pool_scores(pos, raw, m.kernel) if self.pooled else raw
        return top_k_positions(pos, worth, capacity, protect=protect)

    def step_rule(self, layer: int, n_layer: int, prompt_len: int) -> StepRule:
        """``select`` as a native ``topk`` rule over ``step_scores`` (no scores: all tie, the newest persist)."""
        m: ScoredMethod = self.method  # type: ignore[assignment]
        return StepRule("topk", protect_from=self.obs_start, pool_kernel=m.kernel if self.pooled else 1,
                        n_sink=m.n_sink)

    @property
    def step_scores(self) -> tuple[np.ndarray, ...] | None:
        return self.scores


class ScoredMethod(Method):
    """Base class: ``prompt_scorer`` names the scoring pass; selection is ``ScoredPlan``'s."""

    prefill_mode = PrefillMode.PLANNED
    prompt_scorer = ""
    n_sink = 4
    kernel = 1

    def bind(self, budget: float, classes: np.ndarray, n_layer: int, pieces: list[str] | None = None,
             scores: list[np.ndarray] | None = None, pooled: bool = True) -> ScoredPlan:
        """``scores``: per layer, one per prompt position (``engine.prescore``); ``pooled``: smooth them
        (False when they only mark what a restored prefix holds)."""
        caps = tuple(self.capacities(budget, classes, n_layer))
        frozen = None
        if scores is not None:
            frozen = tuple(np.asarray(s, dtype=np.float64) for s in scores)
            for s in frozen:
                s.flags.writeable = False
        return ScoredPlan(self, caps, scores=frozen, obs_start=self.obs_start(np.asarray(classes)), pooled=pooled)

    def obs_end(self, classes: np.ndarray) -> int:
        """The scoring pass reads prompt positions [0, obs_end): the part before the user's turn."""
        return prefix_end(classes)

    def obs_start(self, classes: np.ndarray) -> int:
        """Positions from here on are always kept (the question, the header, the reply)."""
        return self.obs_end(classes)

    def select(self, view: LayerView, capacity: int) -> np.ndarray:
        raise RuntimeError(f"{self.name} selects through its plan: method.bind(...).select(...)")


class SnapKVPrefix(ScoredMethod):
    prompt_scorer = "window-before-query"

    def __init__(self, window: int = 32, kernel: int = 7) -> None:
        self.window = window
        self.kernel = kernel

    def obs_start(self, classes: np.ndarray) -> int:
        return max(0, self.obs_end(classes) - self.window)  # the window itself persists, as in SnapKV


class KVzipStyle(ScoredMethod):
    prompt_scorer = "reconstruction"
    instruction = "\n\nRepeat the previous context exactly.\n"


class KNorm(ScoredMethod):
    prompt_scorer = "key-norm"


class KeyDiff(ScoredMethod):
    prompt_scorer = "key-diff"
