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

A request's run is a step machine (``engine.run``: the public ``RunSteps`` protocol) that does not
own the decode calls: ``execute`` drives it alone in its own context (``run.alone_steps``);
``Engine.start_in_slot`` hands it to the owner of a shared context (``engine.pool``: continuous
batching, one KV stream per request; ``engine.shared``: one prefill for several methods), whose
``SlotSpec`` says which sequence and cells it has. The run delegates its K/V to ``kv_stream`` (the one
sizing rule, the context), eviction to ``evictor`` (native step or reference rules) and reporting to
``run_report`` (stats, trace events).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..chat.decoder import Decoder
from ..chat.protocol import Plan, plan
from ..errors import ContextLengthError, PaskError
from ..grammar.sampling import GREEDY, Sampling
from ..llm import Model
from ..messages import Message, MessageError, ToolChoice, parse_messages, parse_tool_choice, user_message
from ..methods import Method, PrefillMode
from ..model_info import swa_layers
from ..schema.tools import as_tools
from .kv_stream import KV_TYPES, kv_type_id, round_up
from .run import Run, RunSteps, plans_after_prefill, run_alone
from .trace import TraceWriter
from .types import EngineConfig, EngineResult, Prepared, SlotSpec, TokenHook

__all__ = ["KV_TYPES", "Engine", "EngineConfig", "EngineResult", "Prepared", "Run", "RunSteps", "SlotSpec",
           "TokenHook", "holds_whole_prompt", "kv_type_id", "prefills_whole", "round_up"]


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
        run = self.new_run(prepared, trace)
        try:
            run.begin(prepared.plan, prepared.request, on_token)
            return run_alone(run)
        finally:
            run.close()

    def new_run(self, prepared: Prepared, trace: str | Path | None = None, slot: SlotSpec | None = None,
                scores: tuple[list[np.ndarray], float] | None = None) -> Run:
        """A run of ``prepared`` (its K/V allocated, or placed in ``slot``), not yet begun; ``scores``: its
        method's scoring pass, already run (``run.scoring_end``), and its seconds."""
        return Run(self, prepared.plan.prompt, prepared.n_ctx, TraceWriter(trace), slot, prepared.sampling, scores)

    def start_in_slot(self, prepared: Prepared, slot: SlotSpec, on_token: TokenHook | None = None,
                      trace: str | Path | None = None, scores: tuple[list[np.ndarray], float] | None = None
                      ) -> Run:
        """Begin a prepared request in a slot of a shared context; its owner (``engine.pool``,
        ``engine.shared``) decodes its chunks and tokens through the ``RunSteps`` protocol."""
        run = self.new_run(prepared, trace, slot, scores)
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


def holds_whole_prompt(method: Method, cfg: EngineConfig) -> bool:
    """Whether a run of ``method`` under ``cfg`` holds the whole prompt at the end of its prefill: a
    compress-after-prefill method, or a planned one whose plan is applied after it
    (``EngineConfig.plan_after_prefill``)."""
    return prefills_whole(method) or plans_after_prefill(method, cfg)

