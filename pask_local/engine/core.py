"""The PASK engine: one constrained decode loop with per-layer KV persistence under a budget.

``Engine.chat`` answers an OpenAI-style conversation (``Engine.run``: one request, a call required).
It plans the request (``chat.protocol``: the model's own tool-call protocol or the instruction
prompt, tagged; the grammar for ``tool_choice``), sizes every layer's KV capacity with the method
(PASK: the compiled policy; baselines: their own rule), creates a layered-cache context, and
- methods that plan the prompt (``PrefillMode.PLANNED``: PASK with a structural order): decide per layer
  which prompt tokens persist *before* prefill, prefill in chunks and evict the others between
  chunks, so no layer ever holds more than its capacity plus one chunk;
- incremental baselines (``EVICT_WHILE_READING``: StreamingLLM, H2O, TOVA): prefill in chunks, compressing a layer when it
  goes over its capacity, with attention statistics from the native probe where needed;
- ``WHOLE_THEN_COMPRESS`` (SnapKV, PyramidKV, pask-attn, pask-hybrid): prefill the whole prompt (their peak
  is full KV: reported as such), score it with the observation window, compress once;
then decodes (``chat.decoder``: the fast grammar sampler, a lazy grammar for ``auto``, or free
text), tags each new token, and evicts by the method's rule
when a layer passes its budget (which grows with the sequence: budget x tokens so far).
The per-token work (class bookkeeping, attention scores, selection, eviction by cell index) runs
in the native persistence step (``native_step``, patch 0006) from each method's ``step_rule``: one
native call per generated token, evicting a layer in one batch down to its target minus
``hysteresis`` x its prompt capacity. ``EngineConfig.native_step=False`` runs the Python reference (``Method.select``).
Every count reported (held entries, bytes) is read from the native cache, not from Python. The
engine reads what a method needs from its declared attributes (``methods.base.Method``), never
from its name, and runs each request on the method's frozen ``MethodPlan`` (``Method.bind``), so
one method object serves concurrent requests.

``Engine.prepare`` does the planning and sizing (every input error is raised there, before any KV
is allocated; a prompt that does not fit is a ``ContextLengthError``), ``Engine.execute`` runs a
prepared request; its ``on_token`` hook sees each generated token and can stop the loop
(streaming, a client that went away). ``Engine.chat`` is both in one call.

A request's run is a step machine (``begin``, ``prefill_bounds``/``after_chunk``, ``end_prefill``,
``next_token``/``after_token``, ``result``) that does not own the decode calls: ``execute`` drives
it alone in its own context; ``Engine.start_in_slot`` hands it to the owner of a shared context
(``engine.pool``: continuous batching, one KV stream per request; ``engine.shared``: one prefill
for several methods), whose ``SlotSpec`` says which sequence and cells it has.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..attention import LAST, SUM, WINDOW, AttentionProbe, cell_positions, probed_layered_context
from ..chat.decoder import Decoder
from ..chat.messages import Message, MessageError, ToolChoice, parse_messages, parse_tool_choice, user_message
from ..chat.protocol import Plan, plan
from ..chat.result import AssistantMessage
from ..classes import StructuralClass
from ..errors import ContextLengthError, NativeError, PaskError
from ..grammar.sampling import GREEDY, Sampling
from ..kv_layered import kv_total_bytes
from ..llm import Context, ContextConfig, Model
from ..methods import LayerView, Method, PrefillMode
from ..methods.pask import class_indices
from ..model_info import swa_layers
from ..native_step import LayerRule, NativeStep
from ..schema.tools import as_tools
from ..tagging.prompt import Prompt
from .trace import TraceWriter


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


KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # name -> ggml_type


def kv_type_id(name: str) -> int:
    """The ggml_type of a KV cache type name (a PaskError names the choices)."""
    if name not in KV_TYPES:
        raise PaskError(f"unknown KV cache type '{name}' (choose from {', '.join(KV_TYPES)})")
    return KV_TYPES[name]


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
    reuse_source: str = ""  # where the reused prefix came from: "cache" (a finished request), "running" (copied)


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


class Engine:
    """Runs requests on one model with one KV-persistence method."""

    def __init__(self, model: Model, method: Method, config: EngineConfig | None = None,
                 decoder_factory: Callable[[Model, Plan, Sampling], Decoder] = Decoder) -> None:
        self.model = model
        self.method = method
        self.cfg = config or EngineConfig()
        self.decoder_factory = decoder_factory  # builds each request's token chooser (eval.fidelity: forced)
        if not 0.0 < self.cfg.budget <= 1.0:
            raise PaskError(f"budget must be in (0, 1], got {self.cfg.budget}")
        if not 0.0 <= self.cfg.hysteresis <= 0.5:
            raise PaskError(f"hysteresis must be in [0, 0.5], got {self.cfg.hysteresis}")
        kv_type_id(self.cfg.kv_type)
        if self.cfg.kv_type != "f16" and not self.cfg.graph_stats and method.needs_attention and \
                method.prefill_mode != PrefillMode.NONE:
            raise PaskError(f"a {self.cfg.kv_type} KV cache needs flash attention, and the eval-callback probe "
                            f"reads attention scores without it: use graph statistics or --kv-type f16")
        self.swa, self.window = swa_layers(model)

    # ----------------------------------------------------------------- public
    def run(self, tools: Any, request: str, parallel: bool = False,
            examples: list[tuple[str, str]] | None = None, trace: str | Path | None = None) -> EngineResult:
        """One call (or a list with ``parallel``) for one user request: ``chat`` with tool_choice required."""
        return self.chat(user_message(request), tools, "required", parallel=parallel, examples=examples, trace=trace)

    def chat(self, messages: list[Message] | list[dict[str, Any]], tools: Any,
             tool_choice: ToolChoice | str | dict[str, Any] = "auto", parallel: bool = False,
             examples: list[tuple[str, str]] | None = None, trace: str | Path | None = None,
             on_token: TokenHook | None = None, sampling: Sampling = GREEDY) -> EngineResult:
        """Answer an OpenAI-style conversation (``Message``s or their JSON) with ``tools``.

        ``tool_choice``: auto | required | none | ``{"type": "function", "function": {"name": ...}}``;
        ``parallel``: the reply may hold several calls. ``EngineResult.message`` is the reply.
        ``on_token``: see ``execute``. Equal to ``execute(prepare(...))``.
        """
        return self.execute(self.prepare(messages, tools, tool_choice, parallel, examples, sampling), trace, on_token)

    def prepare(self, messages: list[Message] | list[dict[str, Any]], tools: Any,
                tool_choice: ToolChoice | str | dict[str, Any] = "auto", parallel: bool = False,
                examples: list[tuple[str, str]] | None = None, sampling: Sampling = GREEDY) -> Prepared:
        """Validate, render, tag and size one request without touching a llama context.

        Every problem with the input is a ``PaskError`` raised here (before any KV is allocated);
        a prompt that does not fit is a ``ContextLengthError``. Without tools the reply is text
        (``tool_choice`` auto becomes none; required or a named function is an error).
        """
        specs = as_tools(tools) if tools else []
        msgs = [m for m in messages if isinstance(m, Message)]
        if len(msgs) != len(messages):
            msgs = parse_messages(messages)
        choice = parse_tool_choice(tool_choice, [t.name for t in specs])
        if not specs:  # no tools: the reply is text
            if choice.calls:
                raise MessageError(f"tool_choice '{choice.name or choice.mode}' needs tools, and none were given")
            choice = ToolChoice("none")
        p = plan(self.model, specs, msgs, choice, parallel=parallel, style=self.cfg.style, examples=examples,
                 max_string=self.cfg.max_string, max_calls=self.cfg.max_calls)
        request = next((m.content or "" for m in reversed(msgs) if m.role in ("user", "tool")), "")
        n_prompt = len(p.prompt.tokens)
        n_ctx = self.cfg.n_ctx or (n_prompt + self.cfg.max_tokens + 1)
        if n_prompt + self.cfg.max_tokens > n_ctx:
            raise ContextLengthError(f"prompt ({n_prompt} tokens) + max_tokens ({self.cfg.max_tokens}) exceed the "
                                     f"context size {n_ctx}")
        if n_prompt + self.cfg.max_tokens > self.model.n_ctx_train:
            raise ContextLengthError(f"prompt ({n_prompt} tokens) + max_tokens ({self.cfg.max_tokens}) exceed the "
                                     f"model's trained context ({self.model.n_ctx_train})")
        return Prepared(p, request, n_ctx, sampling)

    def execute(self, prepared: Prepared, trace: str | Path | None = None,
                on_token: TokenHook | None = None) -> EngineResult:
        """Prefill and decode a prepared request in a fresh layered-cache context.

        ``on_token(token_id)`` is called for every generated token once the decoder has accepted
        it (end-of-generation tokens excluded), on the thread running the request. A true return
        stops decoding at once: the result then has ``finish == "cancelled"`` and holds the tokens
        so far. It is the hook for streaming and for cancelling (a client that went away).
        """
        run = _Run(self, prepared.plan.prompt, prepared.n_ctx, TraceWriter(trace), sampling=prepared.sampling)
        try:
            return run.execute(prepared.plan, prepared.request, on_token)
        finally:
            run.close()

    def start_in_slot(self, prepared: Prepared, slot: SlotSpec, on_token: TokenHook | None = None,
                      trace: str | Path | None = None) -> _Run:
        """Begin a prepared request in a slot of a shared context; its owner (``engine.pool``,
        ``engine.shared``) decodes its chunks and tokens."""
        run = _Run(self, prepared.plan.prompt, prepared.n_ctx, TraceWriter(trace), slot, prepared.sampling)
        try:
            run.begin(prepared.plan, prepared.request, on_token)
        except BaseException:
            run.close()
            raise
        return run


def prefills_whole(method: Method) -> bool:
    """Whether ``method`` holds the whole prompt before it compresses it (SnapKV-like): in a pool slot
    the prompt must fit the slot's cells, and the window statistic comes from the pool's probe."""
    return method.prefill_mode == PrefillMode.WHOLE_THEN_COMPRESS


def round_up(n: int, align: int = EngineConfig.cell_align) -> int:
    """``n`` rounded up to a multiple of ``align`` (cells: upstream pads n_ctx the same way)."""
    return -(-n // align) * align if align > 1 else n


class _Run:
    """The state of one request: context, per-layer bookkeeping, scores, trace."""

    def __init__(self, engine: Engine, prompt: Prompt, n_ctx: int, trace: TraceWriter,
                 slot: SlotSpec | None = None, sampling: Sampling = GREEDY) -> None:
        self.e = engine
        self.sampling = sampling
        self.model = engine.model
        self.method = engine.method
        self.cfg = engine.cfg
        self.prompt = prompt
        self.trace = trace
        self.n_layer = self.model.n_layer
        self.n_prompt = len(prompt.tokens)
        classes = class_indices(prompt.classes)
        pieces = ([self.model.piece(t).decode("utf-8", "replace") for t in prompt.tokens]
                  if self.method.reads_prompt_text else None)
        self.all_classes = [int(c) for c in classes]
        # this request's rules (capacities, quotas, priorities): the method object itself is shared
        self.mplan = self.method.bind(self.cfg.budget, np.asarray(self.all_classes), self.n_layer, pieces)
        self.mode = self.method.prefill_mode
        self.caps = list(self.mplan.capacities)
        if self.method.scales_swa_capacity:
            # a sliding-window layer's full KV is min(N, W): its share of the budget scales with it
            self.caps = [max(1, math.ceil(c * self.full_size(il, self.n_prompt) / self.n_prompt))
                         for il, c in enumerate(self.caps)]
        self.slot = slot
        self.seq_id = slot.seq_id if slot is not None else 0
        max_len = self.n_prompt + self.cfg.max_tokens
        if slot is not None and self.mode != PrefillMode.NONE:
            # a pool slot's layers have fixed cells: a layer's prompt capacity is cut so that its
            # target after max_tokens plus one chunk in flight fits them
            room = [max(1, (c - self.cfg.chunk - 1) * self.n_prompt // max_len) for c in slot.capacities]
            self.clamped = sum(1 for il, c in enumerate(self.caps) if c > room[il])
            self.caps = [min(c, room[il]) for il, c in enumerate(self.caps)]
        else:
            self.clamped = 0
        self.ratio = [c / self.n_prompt for c in self.caps]
        self.full = self.mode == PrefillMode.NONE
        self.whole = self.mode == PrefillMode.WHOLE_THEN_COMPRESS  # prefilled whole, compressed once
        self.needs_attn = self.method.needs_attention and not self.full
        # an incremental attention method (H2O, TOVA) adds the probe's statistic after every decode
        self.scores_each_decode = self.needs_attn and not self.whole
        if slot is not None and slot.probe is None and (self.needs_attn or prefills_whole(self.method)):
            raise PaskError(f"method '{self.method.name}' reads attention scores or compresses after a whole "
                            f"prefill: it needs a slot with an attention probe")
        if slot is not None:
            self.probe = slot.probe if self.needs_attn else None
        else:
            self.probe = AttentionProbe(self.n_layer, self.cfg.probe_window) if self.needs_attn else None
        # a quantized V cache needs flash attention (llama.cpp); the probe's statistics are computed in
        # the decode graph beside it (patch 0007)
        self.flash_attn = (self.cfg.flash_attn or self.cfg.kv_type != "f16") and \
            (self.cfg.graph_stats or not self.needs_attn)
        kv = kv_type_id(self.cfg.kv_type)
        cfgc = ContextConfig(n_ctx=n_ctx, n_batch=max(self.cfg.chunk, self.cfg.probe_window),
                             flash_attn=self.flash_attn, type_k=kv, type_v=kv)
        if slot is not None:
            self.ctx = slot.ctx
            self.phys = list(slot.capacities)
            self.needed = self.phys
            self.flash_attn = slot.flash_attn
        elif self.full:
            self.ctx: Context = Context(self.model, cfgc)
            self.phys = [n_ctx] * self.n_layer
            self.needed = self.phys
        else:
            if self.whole:
                phys = [max_len] * self.n_layer
            else:
                phys = [min(max_len, self.target(il, self.cfg.max_tokens) + self.cfg.chunk)
                        for il in range(self.n_layer)]
            self.needed = [self._swa_cap(il, p) for il, p in enumerate(phys)]
            # upstream pads n_ctx (and so n_kv) to 256; equal padding keeps budget 1.0 equal to Full KV
            # bit for bit, and the GPU kernels need n_kv % 256 == 0 (the bytes this costs: stats)
            self.phys = [min(round_up(p, self.cfg.cell_align), round_up(max_len, self.cfg.cell_align))
                         for p in self.needed]
            self.ctx = probed_layered_context(self.model, self.phys, cfgc, self.probe, stats=self._probe_stats(),
                                              in_graph=self.cfg.graph_stats)
        # layer groups for reporting: the method's (PASK: its policy's groups)
        self.group_list = self.method.report_groups(self.n_layer)
        self.layer_group = [0] * self.n_layer
        for g, layers in enumerate(self.group_list):
            for il in layers:
                self.layer_group[il] = g
        self.step: NativeStep | None = None
        if not self.full and self.cfg.native_step:
            self.step = self._native_step(max_len)
        self.scores = ([np.zeros(max_len + 1) for _ in range(self.n_layer)]
                       if self.needs_attn and self.step is None else None)

    def _native_step(self, max_len: int) -> NativeStep:
        code = "score" if self.needs_attn else "policy"
        rules = [LayerRule(self.mplan.step_rule(il, self.n_layer, self.n_prompt), cap=self.caps[il],
                           ratio=self.ratio[il], rule_code=code,
                           swa_window=self.e.window if il in self.e.swa and self.e.window > 0 else 0,
                           hysteresis=int(self.cfg.hysteresis * self.caps[il]))
                 for il in range(self.n_layer)]
        stat = self._incremental_stat() if self.scores_each_decode else -1
        step = NativeStep(self.ctx, rules, self.all_classes, max_len, self.n_prompt, self.probe, stat, self.seq_id)
        priority = self.mplan.priority
        if priority is not None:
            step.set_priority(priority)
        step.set_trace(self.trace.enabled)
        return step

    def _flush_events(self) -> None:
        """Write the native step's evictions to the trace, one record per (step, layer, rule) run."""
        if self.step is None or not self.trace.enabled:
            return
        run: list[int] = []
        key = None
        for step, il, p, rule in [*self.step.events(), (None, None, None, None)]:
            if key is not None and (step, il, rule) != key:
                self.trace.write("evict", step=key[0], layer=key[1], group=self.group_of(key[1]),
                                 positions=run, rule=key[2])
                run = []
            key = (step, il, rule)
            run.append(p)

    # ------------------------------------------------------------ budgeting
    def target(self, il: int, n_gen: int) -> int:
        """Entries layer il may hold after n_gen generated tokens: its prompt capacity + ratio x n_gen."""
        return self.caps[il] + math.ceil(self.ratio[il] * n_gen - 1e-9)

    def _swa_cap(self, il: int, cap: int) -> int:
        # a sliding-window layer never needs more cells than its window + the longest chunk in flight
        # (compress-after-prefill methods end the prefill with a probe_window-long chunk)
        longest = max(self.cfg.chunk, self.cfg.probe_window)
        return min(cap, self.e.window + longest) if il in self.e.swa else cap

    # ------------------------------------------------------------- KV ops
    def held(self, il: int) -> np.ndarray:
        return np.asarray(self.ctx.positions(il, self.seq_id), dtype=np.int64)

    def evict_to(self, il: int, capacity: int, step: int, rule: str) -> None:
        if self.step is not None:
            self.step.evict_to(il, capacity, step, rule)
            self._flush_events()
            return
        pos = self.held(il)
        if len(pos) <= capacity:
            return
        cls = np.asarray(self.all_classes, dtype=np.int64)[pos]
        scores = self.scores[il][pos] if self.scores is not None else None
        view = LayerView(layer=il, n_layer=self.n_layer, positions=pos, classes=cls, scores=scores,
                         prompt_len=self.n_prompt, all_classes=np.asarray(self.all_classes, dtype=np.int64))
        keep = self.mplan.select(view, capacity)
        drop = np.setdiff1d(pos, keep)
        if len(drop):
            self.ctx.evict(il, drop.tolist(), self.seq_id)
            self._log_evict(il, drop, step, rule)

    def evict_swa_window(self, now: int, step: int) -> None:
        """Sliding-window layers: positions that left the window can never be attended again."""
        if not self.e.swa or self.e.window <= 0:
            return
        if self.step is not None:
            self.step.drop_window(now, step)
            self._flush_events()
            return
        for il in self.e.swa:
            pos = self.held(il)
            old = pos[pos <= now - self.e.window]
            if len(old):
                self.ctx.evict(il, old.tolist(), self.seq_id)
                self._log_evict(il, old, step, "window")

    def _log_evict(self, il: int, positions: np.ndarray, step: int, rule: str) -> None:
        if self.trace.enabled:
            self.trace.write("evict", step=step, layer=il, group=self.group_of(il),
                             positions=[int(p) for p in positions], rule=rule)

    def group_of(self, il: int) -> int:
        return self.layer_group[il]

    def groups(self) -> list[list[int]]:
        return self.group_list

    def held_counts(self) -> list[int]:
        if self.full:  # upstream cache: every layer holds what it can attend (SWA layers: the window)
            return [self.full_size(il, self.n_seq) for il in range(self.n_layer)]
        return [self.ctx.used(il, self.seq_id) for il in range(self.n_layer)]

    # -------------------------------------------------------------- scores
    def collect_scores(self, what: int) -> None:
        """Add the probe's per-cell statistic of the last decode to each layer's per-position scores."""
        if self.step is not None:
            self.step.collect(what)
            return
        assert self.probe is not None and self.scores is not None
        for il in range(self.n_layer):
            stat = self.probe.stat(il, what, self.seq_id)
            cells = cell_positions(self.ctx, il, self.seq_id)
            n = min(len(stat), len(cells))
            valid = cells[:n] >= 0
            if what == LAST:
                self.scores[il][:] = 0.0
            np.add.at(self.scores[il], cells[:n][valid], stat[:n][valid])

    # ------------------------------------------------------------- prefill
    def prefill_bounds(self) -> list[tuple[int, int]]:
        """The prompt's chunks [a, b), in decode order."""
        n = self.n_prompt
        start = self.slot.reuse if self.slot is not None else 0
        bounds = list(range(start, n, self.cfg.chunk)) + [n]
        if self.whole and n - bounds[-2] < self.cfg.probe_window and len(bounds) > 2:
            # the observation window must lie in the last decoded chunk
            bounds[-2] = max(0, n - self.cfg.probe_window)
            bounds = sorted(set(bounds))
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def _adopt_prefix(self, n: int) -> None:
        """The stream already holds prompt positions < n (what an earlier request with the same prefix
        kept of them): keep what this request's plan keeps of those, as if it had prefilled them."""
        self.n_seq = n
        if self.full:
            return
        self.evict_swa_window(n - 1, -1)
        for il in range(self.n_layer):
            if self.planned is not None and self.planned[il] is not None:
                self._evict_unplanned(il, self.held(il))
            else:
                self.evict_to(il, self.caps[il], -1, "window")

    def _evict_unplanned(self, il: int, positions: np.ndarray) -> None:
        """Evict from layer il those of ``positions`` (prompt positions) its plan does not keep."""
        plan = self.planned[il] if self.planned is not None else None
        if plan is None:  # a sliding-window layer: chosen among what its window still holds
            self.evict_to(il, self.caps[il], -1, "policy")
            return
        drop = positions[~plan[positions]]
        if len(drop):
            self.ctx.evict(il, drop.tolist(), self.seq_id)
            self._log_evict(il, drop, -1, "policy")

    def before_decode(self) -> None:
        if self.probe is not None:
            self.probe.reset()

    def after_chunk(self, a: int, b: int) -> None:
        """Prompt tokens [a, b) were decoded: evict what the method does not keep of them."""
        self.n_seq = b
        if self.full:
            return
        if self.scores_each_decode:
            self.collect_scores(self._incremental_stat())
        # what left a sliding window first: the budget chooses among what the window still holds
        self.evict_swa_window(b - 1, -1)
        if self.planned is not None:
            arrived = np.arange(a, b)
            for il in range(self.n_layer):
                self._evict_unplanned(il, arrived)
        elif not self.whole:
            for il in range(self.n_layer):
                self.evict_to(il, self.caps[il], -1, "score" if self.needs_attn else "window")

    def end_prefill(self) -> None:
        """The whole prompt is in: compress once (compress-after-prefill methods), start decoding."""
        compressed = self.whole
        if compressed:
            self.peak_prefill = self.held_counts()
            if self.needs_attn:
                self.collect_scores(WINDOW)
            for il in range(self.n_layer):
                self.evict_to(il, self.caps[il], -1, "score")
        # the kept cells lie scattered over the cells the prefill wrote (the whole prompt's, or a pool
        # slot's, sized for its longest request): gathered at the bottom, decoding attends n_kv ~ what
        # is held. A slot says whether its cells are its own to move (a shared prefill's are not).
        if self.step is not None and self.cfg.compact and (self.slot.compact if self.slot is not None else compressed):
            self.step.compact()
        if self.probe is not None and not self.scores_each_decode and self.slot is None:
            self.probe.set_enabled(False)  # the statistic is not read while decoding: no host copies
        self.after_prefill = self.held_counts()
        self.t1 = time.perf_counter()
        self.sampler = self.e.decoder_factory(self.model, self.plan, self.sampling)

    def _probe_stats(self) -> tuple[int, ...]:
        """The statistic the method reads: the prompt's window (compressing once) or its per-decode one."""
        return (WINDOW,) if self.whole else (self._incremental_stat(),)

    def _incremental_stat(self) -> int:
        return LAST if self.method.attention_stat == "last" else SUM

    def _prompt_plan(self) -> list[np.ndarray | None]:
        """Per layer: a boolean mask over prompt positions that persist (decided before prefill).

        A sliding-window layer gets none (None): what it can use is what its window holds when a query
        comes, which a plan over the whole prompt cannot know (it kept out-of-window tokens of a
        protected class for in-window ones, and the window then dropped them: at budget 1.0 PASK
        differed from Full KV once a prompt outgrew the window). Such a layer drops what left the
        window after each chunk and then evicts to its capacity by the method's rule."""
        plan: list[np.ndarray | None] = []
        positions = np.arange(self.n_prompt)
        cls = np.asarray(self.all_classes, dtype=np.int64)
        for il in range(self.n_layer):
            if il in self.e.swa and self.e.window > 0:
                plan.append(None)
                continue
            view = LayerView(layer=il, n_layer=self.n_layer, positions=positions, classes=cls,
                             prompt_len=self.n_prompt, all_classes=cls)
            keep = self.mplan.select(view, self.caps[il])
            mask = np.zeros(self.n_prompt, dtype=bool)
            mask[keep] = True
            plan.append(mask)
        return plan

    # ------------------------------------------------------------ the run
    def begin(self, plan: Plan, request: str, on_token: TokenHook | None = None) -> None:
        """Start the request: trace header, the prompt plan; ``prefill_bounds`` come next."""
        self.t0 = time.perf_counter()
        self.plan = plan
        self.on_token = on_token
        self._trace_header(plan.grammar, request)
        self.n_seq = 0
        self.peak_prefill: list[int] | None = None
        self.planned = self._prompt_plan() if self.mode == PrefillMode.PLANNED else None
        if self.slot is not None and self.slot.reuse:
            self._adopt_prefix(self.slot.reuse)
        self.out: list[int] = []
        self.out_classes: list[StructuralClass] = []
        self.finish = "length"
        self.pos = self.n_prompt
        self.n_step = 0
        self.worst_over = 0.0
        self.step_s = 0.0  # time in the per-token persistence step (scores, selection, eviction, counts)
        self.t_decode = 0.0

    def next_token(self, logits: np.ndarray) -> int | None:
        """Choose the next token from ``logits``; None when the reply is finished (``self.finish``)."""
        if self.n_step >= self.cfg.max_tokens:
            return None
        sampler = self.sampler
        tok = sampler.choose(logits)
        if self.model.is_eog(tok):
            self.finish = "eog"
            return None
        cls = sampler.accept(tok)
        self.out.append(tok)
        self.out_classes.append(cls)
        self.all_classes.append(list(StructuralClass).index(cls))
        if self.trace.enabled:
            self.trace.write("token", pos=self.pos, id=tok, text=self.model.piece(tok).decode("utf-8", "replace"),
                             cls=cls.value, phase="gen")
        if self.on_token is not None and self.on_token(tok):
            self.finish = "cancelled"
            return None
        if sampler.done:
            self.finish = "grammar"
            return None
        self.t_decode = time.perf_counter()
        return tok

    def after_token(self) -> None:
        """The token ``next_token`` returned was decoded at ``self.pos``: the persistence step."""
        step, pos = self.n_step, self.pos
        self.n_seq = pos + 1
        t_step = time.perf_counter()
        if self.step is not None:  # one native call: scores, selection, eviction, window
            held = self.step.token(self.all_classes[-1], pos, step + 1)
            self._flush_events()
        else:
            if not self.full:
                if self.scores_each_decode:
                    self.collect_scores(self._incremental_stat())
                self.evict_swa_window(pos, step)
                for il in range(self.n_layer):
                    self.evict_to(il, self.target(il, step + 1), step, "score" if self.needs_attn else "policy")
            held = self.held_counts()
        self.step_s += time.perf_counter() - t_step
        self.worst_over = max(self.worst_over, max(h - self._allowed(il, step + 1) for il, h in enumerate(held)))
        if self.trace.enabled:
            self.trace.write("step", step=step, pos=pos, kept=self._group_sums(held),
                             ms=(time.perf_counter() - self.t_decode) * 1e3)
        self.pos += 1
        self.n_step += 1

    def result(self) -> EngineResult:
        """The finished reply, parsed, with its stats."""
        t2 = time.perf_counter()
        sampler = self.sampler
        sampler.close()
        text = self.model.detokenize(self.out, special=True)
        reply = self.plan.parse(text, self.finish, self.cfg.max_tokens)
        parsed, calls, error = reply.parsed, reply.calls, reply.error
        if sampler.rejected:
            error = "the text after the call opener does not fit the call grammar"
        stats = self._stats(self.after_prefill, len(self.out), self.t0, self.t1, t2, sampler, self.worst_over)
        stats["step_ms_per_token"] = self.step_s * 1e3 / max(1, len(self.out))
        if self.trace.enabled:
            self.trace.write("final", output=text, valid=error is None, retained=self._retained(),
                             n_prompt=self.n_prompt, n_gen=len(self.out), ms_per_token=stats["ms_per_token"])
        return EngineResult(text=text, calls=calls, parsed=parsed, error=error, finish=self.finish,
                            prompt=self.prompt, tokens=self.out, classes=self.out_classes, stats=stats,
                            message=reply.message)

    def execute(self, plan: Plan, request: str, on_token: TokenHook | None = None) -> EngineResult:
        """Run the request alone in this run's own context."""
        self.begin(plan, request, on_token)
        toks = self.prompt.tokens
        for a, b in self.prefill_bounds():
            self.before_decode()
            if self.ctx.decode(toks[a:b], a) != 0:
                raise NativeError(f"llama_decode failed on prompt tokens {a}..{b} (a layer ran out of cells)")
            self.after_chunk(a, b)
        self.end_prefill()
        tok = self.next_token(self.ctx.logits())
        while tok is not None:
            self.before_decode()
            if self.ctx.decode([tok], self.pos) != 0:
                raise NativeError(f"llama_decode failed at position {self.pos} (a layer ran out of cells)")
            self.after_token()
            tok = self.next_token(self.ctx.logits())
        return self.result()

    # ----------------------------------------------------------- reporting
    def full_size(self, il: int, n_tokens: int) -> int:
        if il in self.e.swa and self.e.window > 0:
            return min(n_tokens, self.e.window)
        return n_tokens

    def _allowed(self, il: int, n_gen: int) -> int:
        """The budget check: entries allowed in layer il (never more than full KV would hold)."""
        if self.full:
            return self.n_prompt + n_gen
        return min(self.target(il, n_gen), self.n_prompt + n_gen)

    def _group_sums(self, held: list[int]) -> list[int]:
        return [sum(held[il] for il in layers) for layers in self.groups()]

    def _retained(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for g, layers in enumerate(self.groups()):
            if self.full:
                out[str(g)] = list(range(self.n_seq))
                continue
            common = None
            for il in layers:
                s = set(self.ctx.positions(il, self.seq_id))
                common = s if common is None else common & s
            out[str(g)] = sorted(common or [])
        return out

    def _stats(self, after_prefill, n_gen, t0, t1, t2, sampler, worst_over) -> dict[str, Any]:
        held = self.held_counts()
        n_total = self.n_seq
        full_now = sum(self.full_size(il, n_total) for il in range(self.n_layer))
        full_prefill = sum(self.full_size(il, self.n_prompt) for il in range(self.n_layer))
        groups = self.groups()
        rounding = 0
        if self.slot is not None:
            kv_bytes = self.slot.kv_bytes
        elif self.full:
            kv_bytes = kv_total_bytes(self.ctx)
        else:
            per_layer = [sum(self.ctx.layer_bytes(il)) for il in range(self.n_layer)]
            kv_bytes = sum(per_layer)
            # of those, the bytes of the cells added by rounding capacities up to cell_align
            rounding = sum(b * (self.phys[il] - self.needed[il]) // self.phys[il] for il, b in enumerate(per_layer))
        return {
            "method": self.method.name, "budget": None if self.full else self.cfg.budget,  # full KV: no budget
            "n_prompt": self.n_prompt, "n_gen": n_gen,
            "budget_used_after_prefill": sum(after_prefill) / full_prefill if full_prefill else 1.0,
            "budget_used_final": sum(held) / full_now if full_now else 1.0,
            "peak_prefill_entries": sum(self.peak_prefill) if self.peak_prefill else sum(after_prefill),
            "held_per_group": self._group_sums(held),
            "full_per_group": [sum(self.full_size(il, n_total) for il in layers) for layers in groups],
            "capacity_per_layer": list(self.phys),
            "kv_bytes_allocated": int(kv_bytes),
            "kv_bytes_alignment": int(rounding),  # of kv_bytes_allocated: capacities rounded to cell_align
            "flash_attn": self.flash_attn,
            "graph_stats": self.needs_attn and self.cfg.graph_stats,
            "kv_type": self.slot.kv_type if self.slot is not None else self.cfg.kv_type,
            "slot_clamped_layers": self.clamped,  # layers whose prompt capacity a pool slot cut
            "prefix_reused": self.slot.reuse if self.slot is not None else 0,  # prompt tokens not prefilled
            "prefix_source": self.slot.reuse_source if self.slot is not None else "",
            "max_over_budget_entries": int(worst_over),
            "prefill_ms": (t1 - t0) * 1e3, "gen_ms": (t2 - t1) * 1e3,
            "ms_per_token": (t2 - t1) * 1e3 / max(1, n_gen),
            "sampler": {"fast": sampler.stats.fast, "block": sampler.stats.block, "full": sampler.stats.full},
            "warnings": list(self.mplan.warnings),  # e.g. PASK's floors alone above the budget
        }

    def _trace_header(self, grammar, request: str) -> None:
        if not self.trace.enabled:
            return
        policy = self.method.policy_json()
        self.trace.write("header", version=1, model=self.model.path.name, n_layer=self.n_layer,
                         groups=self.groups(), method=self.method.name,
                         budget=None if self.full else self.cfg.budget,  # null: full KV has no budget
                         request=request, policy=policy, capacity=list(self.phys),
                         swa_layers=list(self.e.swa), window=self.e.window)
        for i, (tok, c) in enumerate(zip(self.prompt.tokens, self.prompt.classes, strict=True)):
            self.trace.write("token", pos=i, id=tok, text=self.model.piece(tok).decode("utf-8", "replace"),
                             cls=c.value, phase="prompt")

    def close(self) -> None:
        self.trace.close()
        if self.step is not None:
            self.step.close()
        if self.slot is None:  # a pool's context (and a shared probe) outlives its requests
            self.ctx.close()
            if self.probe is not None:
                self.probe.close()
