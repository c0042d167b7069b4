"""StreamingLLM (Xiao et al., 2023): keep the first ``n_sink`` tokens and the most recent window."""

from __future__ import annotations

import numpy as np

from .base import LayerView, Method, StepRule


class StreamingLLM(Method):

    def __init__(self, n_sink: int = 4) -> None:
        self.n_sink = n_sink

    def select(self, view: LayerView, capacity: int) -> np.ndarray:
        pos = np.sort(view.positions)
        if len(pos) <= capacity:
            return pos
        sinks = pos[: min(self.n_sink, capacity)]
        window = capacity - len(sinks)
        recent = pos[len(pos) - window:] if window > 0 else pos[:0]
        return np.concatenate([sinks, recent])

    def step_rule(self, layer: int, n_layer: int, prompt_len: int) -> StepRule:
        return StepRule("sink_recent", n_sink=self.n_sink)
