"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention, plus a recent window.

``view.scores`` is each held position's attention mass accumulated over every query so far (summed
over heads). Half of the capacity goes to the most recent tokens, half to the heaviest hitters.
"""

from __future__ import annotations

import numpy as np

from .base import LayerView, Method, StepRule, top_k_positions


class H2O(Method):
    needs_attention = True

    def __init__(self, recent_ratio: float = 0.5) -> None:
        self.recent_ratio = recent_ratio

    def select(self, view: LayerView, capacity: int) -> np.ndarray:
        if len(view.positions) <= capacity:
            return np.sort(view.positions)
        n_recent = int(capacity * self.recent_ratio)
        order = np.argsort(view.positions)
        recent = np.zeros(len(view.positions), dtype=bool)
        if n_recent:
            recent[order[-n_recent:]] = True
        return top_k_positions(view.positions, view.scores, capacity, protect=recent)

    def step_rule(self, layer: int, n_layer: int, prompt_len: int) -> StepRule:
        return StepRule("topk", protect_ratio=self.recent_ratio)
