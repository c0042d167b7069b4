"""What a run reports: its trace events (docs/trace-format.md) and its stats dict (``EngineResult.stats``).

Every count is read from the K/V stream (the native cache), not kept in Python. Tests and the eval
records read these keys: change them only with their readers.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from .kv_stream import KVStream, full_size
from .trace import TraceWriter


class RunTrace:
    """A run's trace events, grouped by the method's reporting layer groups (a no-op without a path)."""

    def __init__(self, writer: TraceWriter, groups: list[list[int]], n_layer: int) -> None:
        self.writer = writer
        self.groups = groups
        self.layer_group = [0] * n_layer
        for g, layers in enumerate(groups):
            for il in layers:
                self.layer_group[il] = g

    @property
    def enabled(self) -> bool:
        return self.writer.enabled

    def group_sums(self, held: list[int]) -> list[int]:
        return [sum(held[il] for il in layers) for layers in self.groups]

    def write(self, kind: str, **fields: Any) -> None:
        self.writer.write(kind, **fields)

    def evict(self, il: int, positions: Iterable[int], step: int, rule: str) -> None:
        if self.enabled:
            self.writer.write("evict", step=step, layer=il, group=self.layer_group[il],
                              positions=[int(p) for p in positions], rule=rule)

    def native_events(self, events: list[tuple[int, int, int, str]]) -> None:
        """The native step's evictions, one record per (step, layer, rule) run of events."""
        if not self.enabled:
            return
        run: list[int] = []
        key: tuple[Any, Any, Any] | None = None
        for step, il, p, rule in [*events, (None, None, None, None)]:
            if key is not None and (step, il, rule) != key:
                self.writer.write("evict", step=key[0], layer=key[1], group=self.layer_group[key[1]],
                                  positions=run, rule=key[2])
                run = []
            key = (step, il, rule)
            run.append(p)

    def retained(self, stream: KVStream, n_seq: int) -> dict[str, list[int]]:
        """Per group: the positions every layer of the group still holds."""
        out: dict[str, list[int]] = {}
        for g, layers in enumerate(self.groups):
            if stream.full:
                out[str(g)] = list(range(n_seq))
                continue
            common: set[int] | None = None
            for il in layers:
                s = set(stream.ctx.positions(il, stream.seq_id))
                common = s if common is None else common & s
            out[str(g)] = sorted(common or [])
        return out

    def close(self) -> None:
        self.writer.close()


@dataclass
class RunClock:
    """A run's measurements between its calls: timings, the prefill's peak, the worst overshoot."""

    t0: float = field(default_factory=time.perf_counter)  # begin
    t1: float = 0.0                   # end of the prefill
    t_decode: float = 0.0             # when the token being decoded was chosen
    step_s: float = 0.0               # time in the per-token persistence step (scores, selection, eviction)
    worst_over: float = 0.0           # most entries a layer held above its allowance
    peak_prefill: list[int] | None = None  # held per layer before a one-time compression
    after_prefill: list[int] = field(default_factory=list)


def run_stats(*, method: str, budget: float | None, n_prompt: int, n_gen: int, n_seq: int, held: list[int],
              clock: RunClock, t2: float, stream: KVStream, trace: RunTrace, swa: Collection[int], window: int,
              graph_stats: bool, clamped: int, sampler_stats: Any, warnings: Iterable[str]) -> dict[str, Any]:
    """The stats dict of a finished run (keys and meaning as ``EngineResult.stats`` documents them)."""
    n_layer = len(held)
    full_now = sum(full_size(il, n_seq, swa, window) for il in range(n_layer))
    full_prefill = sum(full_size(il, n_prompt, swa, window) for il in range(n_layer))
    kv_bytes, rounding = stream.allocated_bytes()
    slot = stream.slot
    after_prefill, t0, t1 = clock.after_prefill, clock.t0, clock.t1
    return {
        "method": method, "budget": budget,  # full KV: no budget
        "n_prompt": n_prompt, "n_gen": n_gen,
        "budget_used_after_prefill": sum(after_prefill) / full_prefill if full_prefill else 1.0,
        "budget_used_final": sum(held) / full_now if full_now else 1.0,
        "peak_prefill_entries": sum(clock.peak_prefill) if clock.peak_prefill else sum(after_prefill),
        "held_per_group": trace.group_sums(held),
        "full_per_group": [sum(full_size(il, n_seq, swa, window) for il in layers) for layers in trace.groups],
        "capacity_per_layer": list(stream.cells),
        "kv_bytes_allocated": int(kv_bytes),
        "kv_bytes_alignment": int(rounding),  # of kv_bytes_allocated: capacities rounded to cell_align
        "flash_attn": stream.flash_attn,
        "graph_stats": graph_stats,
        "kv_type": stream.kv_type,
        "slot_clamped_layers": clamped,  # layers whose prompt capacity a pool slot cut
        "prefix_reused": slot.reuse if slot is not None else 0,  # prompt tokens not prefilled
        "prefix_source": slot.reuse_source if slot is not None else "",
        "max_over_budget_entries": int(clock.worst_over),
        "prefill_ms": (t1 - t0) * 1e3, "gen_ms": (t2 - t1) * 1e3,
        "ms_per_token": (t2 - t1) * 1e3 / max(1, n_gen),
        "sampler": {"fast": sampler_stats.fast, "block": sampler_stats.block, "full": sampler_stats.full},
        "warnings": list(warnings),  # e.g. PASK's floors alone above the budget
        "step_ms_per_token": clock.step_s * 1e3 / max(1, n_gen),
    }
