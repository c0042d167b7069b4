"""Who evicts a run's K/V: the native persistence step, or the Python reference rules (``Method.select``).

Both implement ``Evictor``: collect the probe's statistic, evict a layer to a capacity, drop what
left a sliding window, the per-token step, compaction. The native one runs all of it in one call
per token (``native_step``, patch 0006); the reference one is the oracle it is tested against
(``EngineConfig.native_step=False``). Runs that keep everything (Full KV) have no evictor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence

import numpy as np

from ..attention import LAST, cell_positions
from ..methods import LayerView
from ..methods.base import MethodPlan
from ..native_step import LayerRule, NativeStep
from .kv_stream import KVStream, grown
from .run_report import RunTrace


class Evictor(ABC):
    """Evicts from one run's stream (``stream.seq_id``), logging every eviction to its trace."""

    def __init__(self, stream: KVStream, trace: RunTrace, caps: Sequence[int], n_prompt: int,
                 swa: Collection[int], window: int) -> None:
        self.stream = stream
        self.trace = trace
        self.caps = caps
        self.n_prompt = n_prompt
        self.swa, self.window = swa, window

    def target(self, il: int, n_gen: int) -> int:
        """Entries layer il may hold after n_gen generated tokens: its prompt capacity + ratio x n_gen."""
        return grown(self.caps[il], self.n_prompt, n_gen)

    def drop(self, il: int, positions: np.ndarray, step: int, rule: str) -> None:
        """Evict exactly ``positions`` from layer il (a planned prefill decided them before)."""
        if len(positions):
            self.stream.ctx.evict(il, positions.tolist(), self.stream.seq_id)
            self.trace.evict(il, positions, step, rule)

    def drop_window(self, now: int, step: int) -> None:
        """Sliding-window layers: positions that left the window can never be attended again."""
        if self.swa and self.window > 0:
            self._drop_window(now, step)

    @abstractmethod
    def _drop_window(self, now: int, step: int) -> None: ...

    @abstractmethod
    def collect(self, what: int) -> None:
        """Add the probe's per-cell statistic of the last decode to each layer's per-position scores."""

    @abstractmethod
    def evict_to(self, il: int, capacity: int, step: int, rule: str) -> None:
        """Evict from layer il down to ``capacity`` entries by the method's rule."""

    @abstractmethod
    def token(self, cls: int, pos: int, step: int) -> list[int]:
        """The per-token step after token ``step`` (class ``cls``) was decoded at ``pos``: held per layer."""

    @abstractmethod
    def compact(self) -> None:
        """Gather the held cells at the stream's lowest indices."""

    @abstractmethod
    def close(self) -> None:
        """Free what the evictor holds natively."""


class NativeEvictor(Evictor):
    """The native persistence step: scores, selection, eviction and window in one call per token."""

    def __init__(self, stream: KVStream, trace: RunTrace, caps: Sequence[int], n_prompt: int,
                 swa: Collection[int], window: int, mplan: MethodPlan, classes: list[int], max_len: int,
                 rule_code: str, hysteresis: float, stat: int) -> None:
        super().__init__(stream, trace, caps, n_prompt, swa, window)
        n_layer = len(caps)
        rules = [LayerRule(mplan.step_rule(il, n_layer, n_prompt), cap=caps[il], ratio=caps[il] / n_prompt,
                           rule_code=rule_code, swa_window=window if il in swa and window > 0 else 0,
                           hysteresis=int(hysteresis * caps[il]))
                 for il in range(n_layer)]
        self.step = NativeStep(stream.ctx, rules, classes, max_len, n_prompt, stream.probe, stat, stream.seq_id)
        try:
            if mplan.priority is not None:
                self.step.set_priority(mplan.priority)
            for il, layer_scores in enumerate(mplan.step_scores or ()):
                self.step.set_scores(il, layer_scores)
            self.step.set_trace(trace.enabled)
        except BaseException:
            self.step.close()
            raise

    def _flush(self) -> None:
        if self.trace.enabled:
            self.trace.native_events(self.step.events())

    def collect(self, what: int) -> None:
        self.step.collect(what)

    def evict_to(self, il: int, capacity: int, step: int, rule: str) -> None:
        self.step.evict_to(il, capacity, step, rule)
        self._flush()

    def _drop_window(self, now: int, step: int) -> None:
        self.step.drop_window(now, step)
        self._flush()

    def token(self, cls: int, pos: int, step: int) -> list[int]:
        held = self.step.token(cls, pos, step + 1)
        self._flush()
        return held

    def compact(self) -> None:
        self.step.compact()

    def close(self) -> None:
        self.step.close()


class ReferenceEvictor(Evictor):
    """The Python reference: the method's ``select`` on each layer, scores accumulated in numpy."""

    def __init__(self, stream: KVStream, trace: RunTrace, caps: Sequence[int], n_prompt: int,
                 swa: Collection[int], window: int, mplan: MethodPlan, classes: list[int], max_len: int,
                 rule: str, needs_attn: bool, scores_each_decode: bool, stat: int) -> None:
        super().__init__(stream, trace, caps, n_prompt, swa, window)
        self.mplan = mplan
        self.classes = classes  # the run's list: it grows with every generated token
        self.rule = rule        # what a per-token eviction is logged as
        self.scores_each_decode = scores_each_decode
        self.stat = stat
        self.n_layer = len(caps)
        self.scores = [np.zeros(max_len + 1) for _ in range(self.n_layer)] if needs_attn else None

    def collect(self, what: int) -> None:
        probe, scores, ctx, seq = self.stream.probe, self.scores, self.stream.ctx, self.stream.seq_id
        assert probe is not None and scores is not None
        for il in range(self.n_layer):
            stat = probe.stat(il, what, seq)
            cells = cell_positions(ctx, il, seq)
            n = min(len(stat), len(cells))
            valid = cells[:n] >= 0
            if what == LAST:
                scores[il][:] = 0.0
            np.add.at(scores[il], cells[:n][valid], stat[:n][valid])

    def evict_to(self, il: int, capacity: int, step: int, rule: str) -> None:
        pos = self.stream.held(il)
        if len(pos) <= capacity:
            return
        all_classes = np.asarray(self.classes, dtype=np.int64)
        scores = self.scores[il][pos] if self.scores is not None else None
        view = LayerView(layer=il, n_layer=self.n_layer, positions=pos, classes=all_classes[pos], scores=scores,
                         prompt_len=self.n_prompt, all_classes=all_classes)
        keep = self.mplan.select(view, capacity)
        self.drop(il, np.setdiff1d(pos, keep), step, rule)

    def _drop_window(self, now: int, step: int) -> None:
        for il in self.swa:
            pos = self.stream.held(il)
            self.drop(il, pos[pos <= now - self.window], step, "window")

    def token(self, cls: int, pos: int, step: int) -> list[int]:
        if self.scores_each_decode:
            self.collect(self.stat)
        self.drop_window(pos, step)
        for il in range(self.n_layer):
            self.evict_to(il, self.target(il, step + 1), step, self.rule)
        return self.stream.held_counts(pos + 1)

    def compact(self) -> None:
        pass  # the reference rules leave cells where they are (what the native step is tested against)

    def close(self) -> None:
        pass  # nothing native to free
