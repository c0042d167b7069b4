"""One request's run as a step machine, and the public step protocol its drivers use.

A run does not own the decode calls. Its driver decodes what the run asks for and calls it back, in
this order (``RunSteps``):

    begin -> prefill_bounds -> (decode chunk, after_chunk)* -> end_prefill
          -> next_token(logits) -> (decode token at pos, after_token, next_token(logits))* -> result -> close

Three drivers, the same calls: ``alone_steps`` (``Engine.execute``: the run's own context),
``engine.shared`` (one prefill for several methods) and ``engine.pool`` (continuous batching). The
driver owns the context and its attention probe: it resets the probe before each decode whose
statistic a run reads. The run keeps its state (what it holds, scores, chosen tokens) and delegates:
``kv_stream`` (cells and context), ``evictor`` (native step or reference rules), ``run_report``
(stats, trace events).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator
from typing import Protocol

import numpy as np

from ..attention import LAST, SUM, WINDOW
from ..chat.decoder import Decoder
from ..chat.protocol import Plan
from ..classes import StructuralClass
from ..errors import NativeError, PaskError
from ..grammar.sampling import GREEDY, Sampling
from ..llm import Model
from ..methods import LayerView, Method, PrefillMode
from ..methods.pask import class_indices
from ..tagging.prompt import Prompt
from .evictor import Evictor, NativeEvictor, ReferenceEvictor
from .kv_stream import KVStream, full_size, grown, slot_prompt_room
from .prescore import prompt_scores
from .run_report import RunClock, RunTrace, run_stats
from .trace import TraceWriter
from .types import EngineConfig, EngineResult, SlotSpec, TokenHook


class EngineParts(Protocol):
    """What a run reads of its engine (``core.Engine``)."""

    model: Model
    method: Method
    cfg: EngineConfig
    swa: tuple[int, ...]
    window: int
    decoder_factory: Callable[[Model, Plan, Sampling], Decoder]


class RunSteps(Protocol):
    """The public step protocol (module doc): what every driver calls, and the state it reads.

    Read-only state: ``method``, ``prompt``, ``n_prompt``; ``full`` (nothing is evicted: Full KV),
    ``needs_attn`` (it reads attention statistics), ``scores_each_decode`` (after every decode:
    H2O, TOVA); ``n_seq`` (positions its stream has seen), ``pos`` (where the next token is
    decoded), ``out`` (tokens chosen so far), ``finish`` (why it stopped)."""

    method: Method
    prompt: Prompt
    n_prompt: int
    full: bool
    needs_attn: bool
    scores_each_decode: bool
    n_seq: int
    pos: int
    out: list[int]
    finish: str

    def begin(self, plan: Plan, request: str, on_token: TokenHook | None = None) -> None:
        """Start the request (trace header, the prompt plan, a reused prefix adopted)."""

    def prefill_bounds(self) -> list[tuple[int, int]]:
        """The prompt chunks [a, b) to decode, in order."""

    def after_chunk(self, a: int, b: int) -> None:
        """Prompt tokens [a, b) were decoded in the run's sequence."""

    def end_prefill(self) -> None:
        """The whole prompt is in (after the last ``after_chunk``)."""

    def next_token(self, logits: np.ndarray) -> int | None:
        """The next token to decode at ``pos`` from the last decode's ``logits``; None: finished."""

    def after_token(self) -> None:
        """The token ``next_token`` returned was decoded at ``pos``."""

    def cancel(self) -> None:
        """Its client went away: ``result`` reports ``finish == "cancelled"``."""

    def result(self) -> EngineResult:
        """The finished reply with its stats (once, after the last ``next_token``)."""

    def close(self) -> None:
        """Free what the run holds (its own context; never a driver's shared one)."""


def scoring_end(method: Method, classes: np.ndarray) -> int | None:
    """Where the part of a prompt (its class indices) that ``method``'s scoring pass reads ends
    (``engine.prescore``); None: the method declares no pass."""
    if not method.prompt_scorer:
        return None
    return method.obs_end(classes)  # type: ignore[attr-defined]


def plans_after_prefill(method: Method, cfg: EngineConfig) -> bool:
    """Whether a planned method's plan is applied once after a whole prefill (``EngineConfig.plan_after_prefill``)
    rather than between chunks."""
    return cfg.plan_after_prefill and method.prefill_mode == PrefillMode.PLANNED


class Run:
    """The state of one request (``RunSteps``): per-layer capacities, the prompt plan, chosen tokens."""

    def __init__(self, engine: EngineParts, prompt: Prompt, n_ctx: int, trace: TraceWriter,
                 slot: SlotSpec | None = None, sampling: Sampling = GREEDY,
                 scores: tuple[list[np.ndarray], float] | None = None) -> None:
        """``scores``: the method's scoring pass, already run (``scoring_end``; the pool runs it off its
        thread), with its seconds; None: run here when the method declares one."""
        self.e = engine
        self._score_s = 0.0  # seconds of a scoring pass (``_prompt_scores``)
        self.sampling = sampling
        self.model = engine.model
        self.method = engine.method
        self.cfg = cfg = engine.cfg
        self.prompt = prompt
        self.n_layer = n_layer = self.model.n_layer
        self.n_prompt = n_prompt = len(prompt.tokens)
        swa, window = engine.swa, engine.window
        pieces = ([self.model.piece(t).decode("utf-8", "replace") for t in prompt.tokens]
                  if self.method.reads_prompt_text else None)
        self.all_classes = [int(c) for c in class_indices(prompt.classes)]
        # this request's rules (capacities, quotas, priorities): the method object itself is shared
        self.mplan = self.method.bind(cfg.budget, np.asarray(self.all_classes), n_layer, pieces,
                                      **self._prompt_scores(slot, scores))
        self.mode = self.method.prefill_mode
        caps = list(self.mplan.capacities)
        if self.method.scales_swa_capacity:
            # a sliding-window layer's full KV is min(N, W): its share of the budget scales with it
            caps = [max(1, math.ceil(c * full_size(il, n_prompt, swa, window) / n_prompt))
                    for il, c in enumerate(caps)]
        max_len = n_prompt + cfg.max_tokens
        self.clamped = 0
        if slot is not None and self.mode != PrefillMode.NONE:
            # a pool slot's layers have fixed cells: a layer's prompt capacity is cut so that its
            # target after max_tokens plus one chunk in flight fits them
            room = slot_prompt_room(slot.capacities, n_prompt, cfg.max_tokens, cfg.chunk)
            self.clamped = sum(1 for il, c in enumerate(caps) if c > room[il])
            caps = [min(c, room[il]) for il, c in enumerate(caps)]
        self.caps = caps
        self.full = self.mode == PrefillMode.NONE
        self.whole = self.mode == PrefillMode.WHOLE_THEN_COMPRESS  # prefilled whole, compressed once
        self.plan_after = plans_after_prefill(self.method, cfg)  # prefilled whole, then its plan applied once
        self.holds_whole = self.whole or self.plan_after  # the stream holds the whole prompt until end_prefill
        self.needs_attn = self.method.needs_attention and not self.full
        # an incremental attention method (H2O, TOVA) adds the probe's statistic after every decode
        self.scores_each_decode = self.needs_attn and not self.whole
        self.stat = LAST if self.method.attention_stat == "last" else SUM  # the per-decode statistic
        if slot is not None and slot.probe is None and (self.needs_attn or self.whole):
            raise PaskError(f"method '{self.method.name}' reads attention scores or compresses after a whole "
                            f"prefill: it needs a slot with an attention probe")
        self.slot = slot
        self.stream = KVStream(self.model, cfg, n_ctx, slot, full=self.full, whole=self.holds_whole,
                               needs_attn=self.needs_attn, probe_stats=(WINDOW,) if self.whole else (self.stat,),
                               prompt_caps=caps, n_prompt=n_prompt, swa=swa, window=window)
        # layer groups for reporting: the method's (PASK: its policy's groups)
        self.trace = RunTrace(trace, self.method.report_groups(n_layer), n_layer)
        self.evictor: Evictor | None = None  # Full KV evicts nothing
        rule = "score" if self.needs_attn else "policy"
        if self.full:
            pass
        elif cfg.native_step and self.method.native_step:
            self.evictor = NativeEvictor(self.stream, self.trace, caps, n_prompt, swa, window, self.mplan,
                                         self.all_classes, max_len, rule, cfg.hysteresis,
                                         self.stat if self.scores_each_decode else -1)
        else:
            self.evictor = ReferenceEvictor(self.stream, self.trace, caps, n_prompt, swa, window, self.mplan,
                                            self.all_classes, max_len, rule, self.needs_attn,
                                            self.scores_each_decode, self.stat)

    def _prompt_scores(self, slot: SlotSpec | None, given: tuple[list[np.ndarray], float] | None) -> dict:
        """``bind``'s scores for a method that declares a scoring pass (``engine.prescore``): run on
        the part before the user's turn unless the stream already holds it (a restored prefix)."""
        end = scoring_end(self.method, np.asarray(self.all_classes))
        if end is None:
            return {}
        if slot is not None and slot.reuse >= end:
            # the stream holds that part already (a restored or reused, compressed prefix): what it
            # kept ranks first; nothing evicted from it comes back
            held = [np.zeros(self.n_prompt) for _ in range(self.n_layer)]
            for il, layer in enumerate(held):
                pos = np.asarray(slot.ctx.positions(il, slot.seq_id), dtype=np.int64)  # type: ignore[attr-defined]
                layer[pos[pos < self.n_prompt]] = 1.0
            return {"scores": held, "pooled": False}
        if given is not None:
            self._score_s = given[1]
            return {"scores": given[0]}
        t0 = time.perf_counter()
        scores = prompt_scores(self.model, self.method, list(self.prompt.tokens), end, self.cfg)
        self._score_s = time.perf_counter() - t0
        return {"scores": scores}

    # ------------------------------------------------------------ budgeting
    def target(self, il: int, n_gen: int) -> int:
        """Entries layer il may hold after n_gen generated tokens: its prompt capacity + ratio x n_gen."""
        return grown(self.caps[il], self.n_prompt, n_gen)

    def _allowed(self, il: int, n_gen: int) -> int:
        """The budget check: entries allowed in layer il (never more than full KV would hold)."""
        if self.full:
            return self.n_prompt + n_gen
        return min(self.target(il, n_gen), self.n_prompt + n_gen)

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

    def _evict_unplanned(self, evictor: Evictor, il: int, positions: np.ndarray) -> None:
        """Evict from layer il those of ``positions`` (prompt positions) its plan does not keep."""
        plan = self.planned[il] if self.planned is not None else None
        if plan is None:  # a sliding-window layer: chosen among what its window still holds
            evictor.evict_to(il, self.caps[il], -1, "policy")
            return
        evictor.drop(il, positions[~plan[positions]], -1, "policy")

    def _adopt_prefix(self, n: int) -> None:
        """The stream already holds prompt positions < n (what an earlier request with the same prefix
        kept of them): keep what this request's plan keeps of those, as if it had prefilled them (as
        ``after_chunk`` does: a method that compresses after the whole prompt holds it until then)."""
        self.n_seq = n
        if self.evictor is None:
            return
        self.evictor.drop_window(n - 1, -1)
        if self.holds_whole:
            return
        for il in range(self.n_layer):
            if self.planned is not None and self.planned[il] is not None:
                self._evict_unplanned(self.evictor, il, self.stream.held(il))
            else:
                self.evictor.evict_to(il, self.caps[il], -1, "window")

    # ------------------------------------------------------- the protocol
    def begin(self, plan: Plan, request: str, on_token: TokenHook | None = None) -> None:
        """Start the request: trace header, the prompt plan; ``prefill_bounds`` come next."""
        self.clock = RunClock()
        self.clock.t0 -= self._score_s  # a scoring pass before prefill counts as prefill
        self.plan = plan
        self.on_token = on_token
        self._trace_header(request)
        self.n_seq = 0
        self.planned = self._prompt_plan() if self.mode == PrefillMode.PLANNED else None
        if self.slot is not None and self.slot.reuse:
            self._adopt_prefix(self.slot.reuse)
        self.out: list[int] = []
        self.out_classes: list[StructuralClass] = []
        self.finish = "length"
        self.pos = self.n_prompt
        self.n_step = 0

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

    def after_chunk(self, a: int, b: int) -> None:
        """Prompt tokens [a, b) were decoded: evict what the method does not keep of them."""
        self.n_seq = b
        ev = self.evictor
        if ev is None:
            return
        if self.scores_each_decode:
            ev.collect(self.stat)
        # what left a sliding window first: the budget chooses among what the window still holds
        ev.drop_window(b - 1, -1)
        if self.plan_after:
            return
        if self.planned is not None:
            arrived = np.arange(a, b)
            for il in range(self.n_layer):
                self._evict_unplanned(ev, il, arrived)
        elif not self.whole:
            for il in range(self.n_layer):
                ev.evict_to(il, self.caps[il], -1, "score" if self.needs_attn else "window")

    def end_prefill(self) -> None:
        """The whole prompt is in: compress once (compress-after-prefill methods), start decoding."""
        ev = self.evictor
        if self.holds_whole and ev is not None:
            self.clock.peak_prefill = self.stream.held_counts(self.n_seq)
            if self.whole and self.needs_attn:
                ev.collect(WINDOW)
            for il in range(self.n_layer):
                if self.plan_after:
                    self._evict_unplanned(ev, il, self.stream.held(il))
                else:
                    ev.evict_to(il, self.caps[il], -1, "score")
        # the kept cells lie scattered over the cells the prefill wrote (the whole prompt's, or a pool
        # slot's, sized for its longest request): gathered at the bottom, decoding attends n_kv ~ what
        # is held. A slot says whether its cells are its own to move (a shared prefill's are not).
        if ev is not None and self.cfg.compact and (self.slot.compact if self.slot is not None else self.holds_whole):
            ev.compact()
        self.clock.after_prefill = self.stream.held_counts(self.n_seq)
        self.clock.t1 = time.perf_counter()
        self.sampler = self.e.decoder_factory(self.model, self.plan, self.sampling)

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
        self.clock.t_decode = time.perf_counter()
        return tok

    def after_token(self) -> None:
        """The token ``next_token`` returned was decoded at ``self.pos``: the persistence step."""
        step, pos = self.n_step, self.pos
        self.n_seq = pos + 1
        clock = self.clock
        t_step = time.perf_counter()
        if self.evictor is not None:  # native: one call (scores, selection, eviction, window)
            held = self.evictor.token(self.all_classes[-1], pos, step)
        else:
            held = self.stream.held_counts(self.n_seq)
        clock.step_s += time.perf_counter() - t_step
        clock.worst_over = max(clock.worst_over, max(h - self._allowed(il, step + 1) for il, h in enumerate(held)))
        if self.trace.enabled:
            self.trace.write("step", step=step, pos=pos, kept=self.trace.group_sums(held),
                             ms=(time.perf_counter() - clock.t_decode) * 1e3)
        self.pos += 1
        self.n_step += 1

    def cancel(self) -> None:
        self.finish = "cancelled"

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
        stats = run_stats(method=self.method.name, budget=None if self.full else self.cfg.budget,
                          n_prompt=self.n_prompt, n_gen=len(self.out), n_seq=self.n_seq,
                          held=self.stream.held_counts(self.n_seq), clock=self.clock, t2=t2, stream=self.stream,
                          trace=self.trace, swa=self.e.swa, window=self.e.window,
                          graph_stats=self.needs_attn and self.cfg.graph_stats, clamped=self.clamped,
                          sampler_stats=sampler.stats, warnings=self.mplan.warnings)
        if self.trace.enabled:
            self.trace.write("final", output=text, valid=error is None,
                             retained=self.trace.retained(self.stream, self.n_seq),
                             n_prompt=self.n_prompt, n_gen=len(self.out), ms_per_token=stats["ms_per_token"])
        return EngineResult(text=text, calls=calls, parsed=parsed, error=error, finish=self.finish,
                            prompt=self.prompt, tokens=self.out, classes=self.out_classes, stats=stats,
                            message=reply.message)

    def _trace_header(self, request: str) -> None:
        if not self.trace.enabled:
            return
        self.trace.write("header", version=1, model=self.model.path.name, n_layer=self.n_layer,
                         groups=self.trace.groups, method=self.method.name,
                         budget=None if self.full else self.cfg.budget,  # null: full KV has no budget
                         request=request, policy=self.method.policy_json(), capacity=list(self.stream.cells),
                         swa_layers=list(self.e.swa), window=self.e.window)
        for i, (tok, c) in enumerate(zip(self.prompt.tokens, self.prompt.classes, strict=True)):
            self.trace.write("token", pos=i, id=tok, text=self.model.piece(tok).decode("utf-8", "replace"),
                             cls=c.value, phase="prompt")

    def close(self) -> None:
        self.trace.close()
        if self.evictor is not None:
            self.evictor.close()
        self.stream.close()


def alone_steps(run: Run) -> Generator[None, None, EngineResult]:
    """Drive a begun run in its own context (``Engine.execute``), yielding after every decode; returns
    the result. The driver's share: the decodes, and the probe reset before each of them."""
    ctx, probe = run.stream.ctx, run.stream.probe
    toks = run.prompt.tokens
    for a, b in run.prefill_bounds():
        if probe is not None:
            probe.reset()
        if ctx.decode(toks[a:b], a) != 0:
            raise NativeError(f"llama_decode failed on prompt tokens {a}..{b} (a layer ran out of cells)")
        run.after_chunk(a, b)
        yield
    run.end_prefill()
    if probe is not None and not run.scores_each_decode:
        probe.set_enabled(False)  # the statistic is not read while decoding: no host copies
    tok = run.next_token(ctx.logits())
    while tok is not None:
        if probe is not None:
            probe.reset()
        if ctx.decode([tok], run.pos) != 0:
            raise NativeError(f"llama_decode failed at position {run.pos} (a layer ran out of cells)")
        run.after_token()
        yield
        tok = run.next_token(ctx.logits())
    return run.result()


def run_alone(run: Run) -> EngineResult:
    """``alone_steps`` to the end."""
    steps = alone_steps(run)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
