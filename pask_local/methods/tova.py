"""TOVA (Oren et al., 2024): keep the tokens the current query attends to most.

``view.scores`` is the attention of the newest query (averaged over heads) to each held position;
when the layer is over capacity, the lowest-scored positions go.
"""

from __future__ import annotations

import numpy as np

from .base import LayerView, Method, StepRule, top_k_positions


class TOVA(Method):
    needs_attention = True
    attention_stat = "last"

    def select(self, view: LayerView, capacity: int) -> np.ndarray:
        if len(view.positions) <= capacity:
            return np.sort(view.positions)
        newest = view.positions == view.positions.max()
        return top_k_positions(view.positions, view.scores, capacity, protect=newest)

    def step_rule(self, layer: int, n_layer: int, prompt_len: int) -> StepRule:
        return StepRule("topk", protect_newest=1)
