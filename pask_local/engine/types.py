"""The engine's plain data: its config, a prepared request, a slot in a shared context, a result."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..attention import AttentionProbe
from ..chat.protocol import Plan
from ..chat.result import AssistantMessage
from ..classes import StructuralClass
from ..grammar.sampling import GREEDY, Sampling
from ..llm import Context
from ..tagging.prompt import Prompt


@dataclass
class EngineConfig:
    budget: float = 0.33
    chunk: int = 64               # prefill chunk (tokens); the slack every layer may exceed by
    max_tokens: int = 256
    n_ctx: int = 0                # 0: prompt + max_tokens
    probe_window: int = 32        # observation window (SnapKV) / queries per window statistic
    style: str = "auto"           # prompt style: auto | native | instruction | chat | plain (chat.protocol)
    max_string: int | None = 128  # characters per string value (bounds runaway strings)
    max_calls: int | None = 8     # calls in a parallel list
    native_step: bool = True      # per-token eviction in the native step (False: Python reference rules)
    hysteresis: float = 0.02      # native step: a layer over target evicts this fraction of its prompt
                                  # capacity more at once (0: exactly to target, as the reference rules)
    cell_align: int = 256         # layered capacities round up to a multiple of this (as upstream pads n_ctx)
    flash_attn: bool = False      # flash attention (score methods too: their statistics are computed in the graph)
    compact: bool = True          # after a one-time compression, move the kept cells to the lowest indices
    kv_type: str = "f16"          # K and V cache element type: f16 | q8_0 | q4_0 (quantized: flash attention on)
    graph_stats: bool = True      # attention statistics computed in the decode graph (False: the eval-callback
                                  # probe, the reference: a host copy of every softmax, flash attention off)
    plan_after_prefill: bool = False  # a method that plans the prompt (PrefillMode.PLANNED) prefills it whole and
                                  # then drops what its plan does not keep: the kept entries' K/V are those a full
                                  # prefill computes (compress once, where the prefill's memory is paid once)


@dataclass
class EngineResult:
    text: str
    calls: list[dict[str, Any]]
    parsed: Any
    error: str | None
    finish: str
    prompt: Prompt
    tokens: list[int]
    classes: list[StructuralClass]
    stats: dict[str, Any] = field(default_factory=dict)
    message: AssistantMessage = field(default_factory=AssistantMessage)  # the reply in OpenAI's shape

    @property
    def ok(self) -> bool:
        return self.error is None


TokenHook = Callable[[int], bool | None]
"""Called with each generated token id; returning True stops the decode loop (``Engine.execute``)."""


@dataclass
class SlotSpec:
    """A request's place in a shared context (``engine.pool``): its sequence and its layers' cells."""

    ctx: Context
    seq_id: int
    capacities: list[int]   # cells per layer in this sequence's stream
    kv_bytes: int           # K/V bytes of this sequence's stream
    flash_attn: bool = False
    reuse: int = 0          # prompt positions [0, reuse) already in the stream (a cached prefix)
    kv_type: str = "f16"    # the pool's K/V element type
    probe: AttentionProbe | None = None  # the shared context's probe (pool, shared prefill): its owner resets and frees it
    compact: bool = False   # after the prefill, gather the sequence's held cells at its stream's lowest indices
    reuse_source: str = ""  # where the reused prefix came from: "cache" (a finished request), "running" (copied),
    #                         "prefix" (a prefix file)


@dataclass
class Prepared:
    """A request planned and sized (``Engine.prepare``), ready for ``Engine.execute``."""

    plan: Plan
    request: str          # the last user/tool text (traces)
    n_ctx: int            # the context the run allocates
    sampling: Sampling = GREEDY  # how its tokens are drawn

    @property
    def n_prompt(self) -> int:
        return len(self.plan.prompt.tokens)
