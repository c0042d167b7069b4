"""SnapKV (Li et al., 2024): score the prompt with an observation window at its end.

The last ``window`` prompt tokens (they include the question) are the observation window and are
always kept. Every other prompt position is scored by the attention the window's queries pay to it
(``view.scores``: summed over the window's queries and over the heads of the layer), smoothed by
1-D average pooling (``kernel``) along positions, and the top-k survive. The prompt is prefilled
whole and compressed once; generated tokens are then appended without further eviction unless
the layer fills up (then the oldest non-window, lowest-score ones go first).
"""

from __future__ import annotations

import numpy as np

from .base import LayerView, Method, PrefillMode, StepRule, top_k_positions


def pool_scores(positions: np.ndarray, scores: np.ndarray, kernel: int) -> np.ndarray:
    """Average-pool scores along sorted positions (same length, edge-padded); returns input order."""
    if kernel <= 1 or len(scores) == 0:
        return scores.astype(np.float64)
    order = np.argsort(positions)
    s = scores[order].astype(np.float64)
    pad = kernel // 2
    padded = np.pad(s, (pad, kernel - 1 - pad), mode="edge")
    pooled = np.convolve(padded, np.ones(kernel) / kernel, mode="valid")
    out = np.empty_like(pooled)
    out[order] = pooled
    return out


class SnapKV(Method):
    needs_attention = True
    prefill_mode = PrefillMode.WHOLE_THEN_COMPRESS

    def __init__(self, window: int = 32, kernel: int = 7) -> None:
        self.window = window
        self.kernel = kernel

    def select(self, view: LayerView, capacity: int) -> np.ndarray:
        if len(view.positions) <= capacity:
            return np.sort(view.positions)
        obs_start = max(0, view.prompt_len - self.window)
        protect = view.positions >= obs_start
        pooled = pool_scores(view.positions, view.scores, self.kernel)
        return top_k_positions(view.positions, pooled, capacity, protect=protect)

    def step_rule(self, layer: int, n_layer: int, prompt_len: int) -> StepRule:
        return StepRule("topk", protect_from=max(0, prompt_len - self.window), pool_kernel=self.kernel)
