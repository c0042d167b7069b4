"""PyramidKV (Cai et al., 2024): SnapKV's selection with layer budgets decreasing with depth.

Capacities form an arithmetic sequence from the first to the last layer whose mean is the uniform
budget; the last layer gets ``min_ratio`` of the mean (raised when the first layer would exceed
every token), so the total equals the uniform budget.
"""

from __future__ import annotations

import math

import numpy as np

from .snapkv import SnapKV


class PyramidKV(SnapKV):

    def __init__(self, window: int = 32, kernel: int = 7, min_ratio: float = 0.4) -> None:
        super().__init__(window, kernel)
        self.min_ratio = min_ratio

    def capacities(self, budget: float, classes: np.ndarray, n_layer: int) -> list[int]:
        n_tokens = len(classes)
        mean = budget * n_tokens
        if n_layer == 1:
            return [max(1, math.ceil(mean))]
        # the first layer may hold at most every token: raise the floor when the budget is large
        low = max(self.min_ratio * mean, 2 * mean - n_tokens)
        high = 2 * mean - low
        caps = [high - (high - low) * il / (n_layer - 1) for il in range(n_layer)]
        return [max(1, min(n_tokens, round(c))) for c in caps]
