"""Full KV: every position stays (the reference every method is measured against)."""

from __future__ import annotations

import numpy as np

from .base import LayerView, Method, PrefillMode


class FullKV(Method):
    prefill_mode = PrefillMode.NONE

    def capacities(self, budget: float, classes: np.ndarray, n_layer: int) -> list[int]:
        return [len(classes)] * n_layer

    def select(self, view: LayerView, capacity: int) -> np.ndarray:
        return np.sort(view.positions)
