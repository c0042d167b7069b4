"""Continuous batching: many requests decoded together in one persistent llama context.

``SlotPool`` owns one context whose KV memory is fixed when it starts: ``slots`` sequences, each
its own KV stream, every layer of a stream a fixed number of cells (Full KV: the slot length; a
compressed method: budget x slot length + one prefill chunk, rounded up to 256 cells, sliding-window
layers at most their window + a chunk; a policy whose layer groups keep different shares of the
budget sizes each layer by its group's share, ``Method.layer_keep``). ``SlotPool.layout_for(kv_mem=...)`` derives the slot count
from a memory size, so that at equal memory a budget of 0.33 gets about three times the slots of Full KV.

One queue, one loop (as llama.cpp server's ``update_slots``). ``submit`` puts a request in the pool's
queue (``request_queue``: arrival order; ``QueueFull`` when running + waiting reach slots +
``queue_size``) and returns its future. One thread runs the loop: it admits waiting requests to
free sequences (the lowest free id; ``prefix_cache`` says where each starts, or that it waits for a
running request to decode the prefix they share), then runs one step: ``plan_step`` (``step_plan``,
pure: who feeds which prompt chunk or token) and ``run_step`` (one ``llama_decode`` of that batch,
then each request's own run, ``Engine.start_in_slot``: its method, its native persistence step on
its sequence id, its grammar, evicts and chooses its next token from its own logits row). A request
whose ``cancelled`` turns true (a client that went away: checked every step, prefill included) or
whose token hook asks to stop frees its slot at the next step. A failed decode fails the requests
in that batch and clears their sequences; the pool goes on serving. ``close`` fails what waits and
what runs.

A request whose method declares a scoring pass (``engine.prescore``: kvzip, knorm, ...) and whose
slot would not start from a stream that already holds the scored part (a pinned prefix file, a held
stream) has the pass run on the pool's scoring thread, one pass at a time; it waits in the queue,
keeping its place, while the loop goes on stepping the running requests, and is admitted once its
scores are ready.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..attention import LAST, SUM, WINDOW, AttentionProbe
from ..errors import NativeError, PaskError
from ..kv_layered import LayeredContext, kv_total_bytes
from ..llm import Context, Model
from ..methods import Method
from ..methods.pask import class_indices
from ..model_info import swa_layers
from .core import (
    Engine,
    EngineConfig,
    EngineResult,
    Prepared,
    SlotSpec,
    TokenHook,
    holds_whole_prompt,
    prefills_whole,
)
from .kv_stream import context_config, flash_attn_for, layer_cells, round_up
from .prefix_cache import REUSE_MODES, Pinned, PrefixCache, Source, Start, common_prefix
from .prescore import prompt_scores
from .request_queue import PoolClosed, QueueFull, RequestCancelled, RequestQueue
from .run import scoring_end
from .step_plan import SlotState, StepPlan, plan_step

__all__ = ["REUSE_MODES", "Pinned", "PoolClosed", "PoolLayout", "QueueFull", "RequestCancelled", "SlotPool", "common_prefix",
           "slot_capacities", "slot_keep"]


@dataclass
class PoolLayout:
    """What a pool allocates: cells per layer of one slot, and the slot count."""

    full: bool                 # an upstream cache (Full KV) instead of the layered one
    capacities: list[int]      # cells per layer in each slot's stream
    slots: int
    slot_len: int              # prompt + max_tokens one slot holds
    budget: float              # the largest budget a request may ask for (1.0: Full KV)
    kv_type: str = "f16"       # K/V element type (quantized: flash attention on)


def slot_keep(model: Model, method: Method, budget: float) -> list[float]:
    """Each layer's share of a slot's length that its cells are sized by: the budget, or the layer's
    own share where the layers of a method that compresses while it reads keep different shares
    (``Method.layer_keep``: a calibrated policy's layer groups). A whole-prompt method's layers each
    hold the whole prompt until it compresses: sized by the budget."""
    keep = None if method.compress_after_prefill else method.layer_keep(budget, model.n_layer)
    return keep or [budget] * model.n_layer


def slot_capacities(model: Model, method: Method, budget: float, slot_len: int, chunk: int) -> list[int]:
    """Cells per layer of one slot for ``method`` at ``budget`` (see the module doc): the engine's
    sizing rule (``kv_stream.layer_cells``) for a slot_len-token stream whose every layer holds its
    ``slot_keep`` share of slot_len (Full KV: all of it, sliding-window layers included)."""
    if method.keeps_all:
        return layer_cells(model.n_layer, None, slot_len, 0, chunk).cells
    swa, window = swa_layers(model)
    keep = slot_keep(model, method, budget)
    return layer_cells(model.n_layer, [math.ceil(k * slot_len) for k in keep], slot_len, 0, chunk,
                       swa, window).cells


_keys = itertools.count()


@dataclass
class _Request:
    engine: Engine
    prepared: Prepared
    on_token: TokenHook | None
    cancelled: Callable[[], bool]
    trace: str | Path | None = None  # a JSONL trace path for this request (as ``pask-local run --trace``)
    future: Future[EngineResult] = field(default_factory=Future)
    key: int = field(default_factory=lambda: next(_keys))
    run: Any = None            # the engine's run once admitted (``run.RunSteps``)
    seq: int = -1
    chunks: list[tuple[int, int]] = field(default_factory=list)
    next_chunk: int = 0
    token: int | None = None   # the token to decode next (decoding phase)
    order: int = 0             # admission order
    scoring: Future[tuple[list[np.ndarray], float]] | None = None  # its scoring pass and its seconds

    @cached_property
    def score_end(self) -> int | None:
        """Where the part its method's scoring pass reads ends (None: no pass); asked at every
        admission attempt, computed once."""
        return scoring_end(self.engine.method, class_indices(self.prepared.plan.prompt.classes))

    @property
    def blocked(self) -> bool:
        """It waits for its scoring pass (nothing to admit until it ends)."""
        return self.scoring is not None and not self.scoring.done()

    @property
    def prefilling(self) -> bool:
        """Prompt chunks are still to decode."""
        return self.next_chunk < len(self.chunks)

    def state(self) -> SlotState:
        """What the step planner reads (``cancelled`` asked once)."""
        run = self.run
        return SlotState(self.key, self.seq, self.order, tuple(self.chunks), self.next_chunk, run.n_prompt,
                         reads_window=run.needs_attn and run.method.compress_after_prefill,
                         scores_each_decode=run.scores_each_decode, cancelled=self.cancelled())

    def source(self) -> Source:
        """What the prefix cache reads of this running request's stream (``cancelled`` asked once)."""
        run = self.run
        return Source(self.seq, run.prompt.tokens, run.n_seq, run.full, run.method.compress_after_prefill,
                      self.chunks[-1][0], self.next_chunk > 0, cancelled=self.cancelled())


class SlotPool:
    """One persistent context serving up to ``layout.slots`` requests at once."""

    def __init__(self, model: Model, layout: PoolLayout, chunk: int = EngineConfig.chunk,
                 flash_attn: bool = False, start: bool = True, prefill_tokens: int = 0,
                 prefix_cache: bool = True, min_reuse: int = 32, reuse: str = "exact",
                 queue_size: int | None = None) -> None:
        """``start=False``: requests queue until ``start()`` (all admitted together: reproducible batches).

        ``prefill_tokens``: prompt tokens one step may carry (the prefilling requests with the least
        prompt left first, at least one chunk), which bounds how much a prefill slows the decoding
        slots; 0: a chunk for every prefilling request. ``prefix_cache``, ``min_reuse``, ``reuse``: the
        prefix cache (``engine.prefix_cache``). ``queue_size``: requests that may wait for a slot
        (beyond: ``QueueFull``); None: any number."""
        if layout.slots < 1:
            raise PaskError(f"a pool needs at least one slot, got {layout.slots}")
        self.model = model
        self.layout = layout
        self.chunk = chunk
        self.prefill_tokens = prefill_tokens
        swa, window = swa_layers(model)
        self._swa = set(swa) if window > 0 else set()  # sliding-window layers
        self._window = window
        self.cache = PrefixCache(prefix_cache, reuse, min_reuse, chunk, window if self._swa else None,
                                 self._holds_whole)
        self.queue: RequestQueue[_Request] = RequestQueue(layout.slots, queue_size)
        self.reused_tokens = 0                          # prompt tokens not prefilled thanks to the cache
        self.shared_tokens = 0                          # of those, copied from a running request's stream
        n_batch = layout.slots * chunk
        flash_attn = flash_attn_for(layout.kv_type, flash_attn)
        cfg = context_config(layout.slots * round_up(layout.slot_len), n_batch, layout.kv_type, flash_attn,
                             n_seq_max=layout.slots)
        self.flash_attn = flash_attn
        self.probe: AttentionProbe | None = None
        if layout.full:
            self.ctx: Context = Context(model, cfg)
            self.kv_bytes = kv_total_bytes(self.ctx)
        else:
            self.ctx = LayeredContext(model, layout.capacities, cfg, unified=False)
            self.kv_bytes = self.ctx.kv_bytes()
            # H2O and TOVA read attention every step, SnapKV-like methods the window of their prompt's
            # last chunk: the decode graph computes it per stream (one per slot), only in steps where a
            # running request reads it
            self.probe = AttentionProbe(model.n_layer, EngineConfig.probe_window)
            self.probe.attach(self.ctx, (SUM, WINDOW, LAST), max(layout.capacities))
            self.probe.set_enabled(False)
        # a method that compresses after a whole prefill holds the whole prompt in its slot until then
        self.whole_prompt_room = min((c for il, c in enumerate(layout.capacities) if il not in self._swa),
                                     default=min(layout.capacities))
        self.slot_bytes = self.kv_bytes // layout.slots
        self._free = list(range(layout.slots))
        self._active: list[_Request] = []
        self._order = itertools.count()
        self.steps = 0                      # llama_decode calls
        self.step_tokens = 0                # tokens decoded in them
        self.max_prompt_step = 0            # most prompt tokens one step carried
        self.step_s = 0.0                   # time in llama_decode
        self.host_s = 0.0                   # time in the runs between decodes (sampling, tagging, eviction)
        self._thread = threading.Thread(target=self._loop, name="pask-pool", daemon=True)
        # scoring passes (one at a time: each is a prefill of its own, competing with the pool for the CPU)
        self._scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pask-score")
        if start:
            self.start()

    def start(self) -> None:
        """Start the step loop (once)."""
        if not self._thread.is_alive() and not self.queue.closed:
            self._thread.start()

    # ------------------------------------------------------------- sizing
    @staticmethod
    def layout_for(model: Model, method: Method, budget: float, slot_len: int, slots: int | None = None,
                   kv_mem: int | None = None, chunk: int = EngineConfig.chunk, kv_type: str = "f16") -> PoolLayout:
        """The layout for ``slots`` slots, or for as many as fit in ``kv_mem`` bytes of K/V."""
        if slot_len < 2:
            raise PaskError(f"a slot must hold at least 2 tokens, got {slot_len}")
        full = method.keeps_all
        caps = slot_capacities(model, method, budget, slot_len, chunk)
        if kv_mem is not None:
            one = SlotPool._measure(model, full, caps, slot_len, kv_type)
            slots = kv_mem // one
            if slots < 1:
                raise PaskError(f"--kv-mem {kv_mem >> 20} MiB holds no slot: one {method.name} slot of "
                                f"{slot_len} tokens needs {math.ceil(one / (1 << 20))} MiB")
        if slots is None or slots < 1:
            raise PaskError(f"a pool needs at least one slot, got {slots}")
        return PoolLayout(full=full, capacities=caps, slots=int(slots), slot_len=slot_len,
                          budget=1.0 if full else budget, kv_type=kv_type)

    @staticmethod
    def slot_kv_bytes(model: Model, method: Method, budget: float, slot_len: int, kv_type: str = "f16",
                      chunk: int = EngineConfig.chunk) -> int:
        """K/V bytes one slot of ``method`` at ``budget`` takes (measured on a one-slot context)."""
        caps = slot_capacities(model, method, budget, slot_len, chunk)
        return SlotPool._measure(model, method.keeps_all, caps, slot_len, kv_type)

    @staticmethod
    def _measure(model: Model, full: bool, caps: list[int], slot_len: int, kv_type: str = "f16") -> int:
        """K/V bytes of one slot, read from a one-slot context of the same kind."""
        cfg = context_config(round_up(slot_len), EngineConfig.cell_align, kv_type, flash_attn_for(kv_type))
        ctx: Context = Context(model, cfg) if full else LayeredContext(model, caps, cfg)
        try:
            return kv_total_bytes(ctx) if full else ctx.kv_bytes()
        finally:
            ctx.close()

    # ------------------------------------------------------------- public
    @property
    def busy(self) -> int:
        """Slots holding a request now."""
        return self.queue.running

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self.queue.waiting)

    def check(self, engine: Engine, prepared: Prepared) -> None:
        """Raise ``PaskError`` if the request cannot run in this pool (before it waits for a slot)."""
        method, lay = engine.method, self.layout
        if method.keeps_all != lay.full:
            raise PaskError(f"this pool's slots hold {'full KV' if lay.full else f'budget {lay.budget}'}: "
                            f"method '{method.name}' needs a server started with --method {method.name}")
        if engine.cfg.kv_type != lay.kv_type:
            raise PaskError(f"this pool's KV cache is {lay.kv_type}, the request's {engine.cfg.kv_type}")
        if not method.keeps_all and engine.cfg.budget > lay.budget + 1e-9:
            raise PaskError(f"budget {engine.cfg.budget} is above this pool's {lay.budget}")
        if holds_whole_prompt(method, engine.cfg):
            if prepared.n_prompt > self.whole_prompt_room:
                raise PaskError(f"method '{method.name}' prefills the whole prompt before it compresses: a slot "
                                f"of this pool holds {self.whole_prompt_room} prompt tokens at once, the prompt has "
                                f"{prepared.n_prompt} (use a method that compresses while it reads, such as pask, "
                                f"or a server started with --no-batch)")
            if engine.cfg.probe_window != EngineConfig.probe_window:
                raise PaskError(f"this pool's observation window is {EngineConfig.probe_window} tokens, the "
                                f"request's {engine.cfg.probe_window}")
        need = prepared.n_prompt + engine.cfg.max_tokens
        if need > lay.slot_len:
            raise PaskError(f"prompt ({prepared.n_prompt} tokens) + max_tokens ({engine.cfg.max_tokens}) exceed "
                            f"a slot's {lay.slot_len} tokens")

    def submit(self, engine: Engine, prepared: Prepared, on_token: TokenHook | None = None,
               cancelled: Callable[[], bool] = lambda: False, trace: str | Path | None = None) -> Future[EngineResult]:
        """Queue a prepared request; its future holds the result (or the error). Raises ``PaskError`` for a
        request this pool cannot run, ``QueueFull`` when the queue is full, ``PoolClosed`` after ``close``.
        ``cancelled``: the request's cancel flag, read every step; ``trace``: a JSONL trace of the request,
        as ``pask-local run --trace`` writes."""
        self.check(engine, prepared)
        req = _Request(engine, prepared, on_token, cancelled, trace=trace)
        self.queue.put(req)
        return req.future

    def execute(self, engine: Engine, prepared: Prepared, on_token: TokenHook | None = None,
                cancelled: Callable[[], bool] = lambda: False) -> EngineResult:
        """Run a prepared request in the pool; blocks until it is answered (or fails)."""
        return self.submit(engine, prepared, on_token, cancelled).result()

    def pin(self, prefix: Pinned) -> None:
        """Offer a prefix compressed on its own (a prefix file) to every later request (``prefix_cache``)."""
        with self.queue.cond:
            self.cache.pin(prefix)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the step loop (requests still running or waiting fail) and free the context."""
        for req in self.queue.close():
            req.future.set_exception(PoolClosed("the server is shutting down"))
        self._scorer.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            self._thread.join(timeout)
        else:  # never started: nothing runs
            self._fail_all(PoolClosed("the server is shutting down"))
        if not self._thread.is_alive():
            self.ctx.close()
            if self.probe is not None:
                self.probe.close()

    def stats(self) -> dict[str, Any]:
        lay = self.layout
        return {"slots": lay.slots, "slot_len": lay.slot_len, "kv_type": lay.kv_type, "kv_bytes": self.kv_bytes,
                "slot_bytes": self.slot_bytes, "capacity_per_layer": lay.capacities, "steps": self.steps,
                "tokens_per_step": self.step_tokens / self.steps if self.steps else 0.0,
                "max_prompt_tokens_per_step": self.max_prompt_step,
                "reused_prompt_tokens": self.reused_tokens,
                "shared_prompt_tokens": self.shared_tokens, "decode_s": self.step_s, "host_s": self.host_s,
                "host_share": self.host_s / (self.host_s + self.step_s) if self.step_s else 0.0}

    # ---------------------------------------------------------- the loop
    def _loop(self) -> None:
        q = self.queue
        while True:
            with q.cond:
                # idle until a request can be admitted (one waiting for its scoring pass cannot)
                while not q.closed and not self._active and all(r.blocked for r in q.waiting):
                    q.cond.wait()
                if q.closed:
                    break
                self._admit()
            if self._active:
                t0 = time.perf_counter()
                self.run_step(plan_step([r.state() for r in self._active], self.chunk, self.prefill_tokens), t0)
        self._fail_all(PoolClosed("the server is shutting down"))

    def _admit(self) -> None:
        """Waiting requests to free sequences, in arrival order (the caller holds the queue's lock)."""
        q = self.queue
        deferred: list[_Request] = []
        while q.waiting and self._free:
            req = q.waiting.popleft()
            if req.cancelled():
                req.future.set_exception(RequestCancelled("the request was cancelled before it started"))
                continue
            method = req.engine.method
            start = self.cache.lookup(req.prepared.plan.prompt.tokens, self._free,
                                      lambda: [r.source() for r in self._active],
                                      full=method.keeps_all, whole=prefills_whole(method), method=method.name,
                                      budget=None if method.keeps_all else req.engine.cfg.budget)
            if start is None:  # a running request is still prefilling the prefix it shares: wait for it
                deferred.append(req)
                continue
            end = req.score_end
            scores = None
            if end is not None and start.reuse < end:  # its scoring pass: on the scoring thread
                if req.scoring is None:
                    req.scoring = self._scorer.submit(self._score, req, end)
                if not req.scoring.done():
                    deferred.append(req)
                    continue
                try:
                    scores = req.scoring.result()
                except BaseException as exc:
                    req.future.set_exception(exc)
                    continue
            self._claim(start)
            spec = SlotSpec(self.ctx, start.seq, self.layout.capacities, self.slot_bytes, self.flash_attn,
                            start.reuse, self.layout.kv_type, compact=True, probe=self.probe,
                            reuse_source="running" if start.shared else
                            ("prefix" if start.pinned else "cache" if start.reuse else ""))
            try:
                if start.pinned is not None:
                    start.pinned.restore(self.ctx, start.seq)
                req.run = req.engine.start_in_slot(req.prepared, spec, req.on_token, trace=req.trace, scores=scores)
            except BaseException as exc:
                self.ctx.seq_rm(start.seq, -1, -1)
                self._free.append(start.seq)
                req.future.set_exception(exc)
                continue
            self.reused_tokens += start.reuse
            self.shared_tokens += start.reuse if start.shared else 0
            req.seq = start.seq
            req.chunks = req.run.prefill_bounds()
            req.order = next(self._order)
            self._active.append(req)
            q.running = len(self._active)
        q.put_back(deferred)

    def _score(self, req: _Request, end: int) -> tuple[list[np.ndarray], float]:
        """``req``'s scoring pass and its seconds (on the scoring thread); the loop is woken when it ends."""
        try:
            if req.cancelled():
                raise RequestCancelled("the request was cancelled before it started")
            e, t0 = req.engine, time.perf_counter()
            scores = prompt_scores(e.model, e.method, list(req.prepared.plan.prompt.tokens), end, e.cfg)
            return scores, time.perf_counter() - t0
        finally:
            with self.queue.cond:
                self.queue.cond.notify_all()

    def _claim(self, start: Start) -> None:
        """Take ``start.seq`` from the free streams and the cache; keep only the prefix it reuses."""
        self._free.remove(start.seq)
        self.cache.claim(start)
        if start.shared:
            self.ctx.seq_rm(start.seq, -1, -1)
            self.ctx.seq_cp(start.copy_from, start.seq)  # the data moves at the next decode, before its graph runs
        if start.pinned is not None:  # restored in place by the admission
            self.ctx.seq_rm(start.seq, -1, -1)
            return
        self.ctx.seq_rm(start.seq, start.reuse, -1)  # the rest of the earlier request (all of it without reuse)

    def _holds_whole(self, seq: int, n: int) -> bool:
        """Every layer of ``seq``'s stream holds each of the positions < n it can attend (a
        sliding-window layer: those inside its window)."""
        if self.layout.full:
            return True
        for il in range(self.model.n_layer):
            lo = max(0, n - self._window) if il in self._swa else 0
            held = np.asarray(self.ctx.positions(il, seq), dtype=np.int64)
            if int(np.count_nonzero((held >= lo) & (held < n))) != n - lo:
                return False
        return True

    def _release(self, req: _Request, result: EngineResult | None = None, exc: BaseException | None = None) -> None:
        try:
            if result is None and exc is None:
                try:
                    result = req.run.result()
                except BaseException as e:  # a reply that cannot be built is that request's failure
                    exc = e
            req.run.close()
        finally:
            run = req.run
            kept = exc is None and run.n_seq > 0 and self.cache.hold(
                req.seq, (list(run.prompt.tokens) + run.out)[:run.n_seq])
            if not kept:
                self.ctx.seq_rm(req.seq, -1, -1)
            self._free.append(req.seq)
        try:  # answered before the slot counts as free: whoever sees it free sees the answer's effects
            if exc is not None:
                req.future.set_exception(exc)
            else:
                req.future.set_result(result)
        finally:
            self._active.remove(req)
            with self.queue.cond:
                self.queue.running = len(self._active)
                self.queue.cond.notify_all()

    def _fail_all(self, err: BaseException) -> None:
        for req in list(self._active):
            self._release(req, exc=err)

    def run_step(self, plan: StepPlan, t0: float | None = None) -> None:
        """Carry out ``plan``: release the cancelled, one llama_decode of the fed requests, then each
        request's own bookkeeping. ``t0``: when the host's share of this step began (planning)."""
        t0 = time.perf_counter() if t0 is None else t0
        by_key = {r.key: r for r in self._active}
        for key in plan.release:
            req = by_key[key]
            if req.prefilling:  # no reply to build
                self._release(req, exc=RequestCancelled("the request was cancelled while its prompt was read",
                                                        started=True))
            else:
                req.run.cancel()
                self._release(req)
        toks: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        want: list[bool] = []
        rows: list[tuple[_Request, int]] = []   # (request, its logits row or -1)
        for f in plan.feeds:
            req = by_key[f.key]
            run = req.run
            if f.chunk is not None:
                a, b = f.chunk
                toks.extend(run.prompt.tokens[a:b])
                pos.extend(range(a, b))
                seqs.extend([req.seq] * (b - a))
                want.extend(f.logits and p == b - 1 for p in range(a, b))
            else:
                toks.append(req.token)
                pos.append(run.pos)
                seqs.append(req.seq)
                want.append(True)
            rows.append((req, len(toks) - 1 if f.logits else -1))
        if not rows:
            return
        self.max_prompt_step = max(self.max_prompt_step, plan.prompt_tokens)
        if self.probe is not None:  # statistics only in steps that a running request reads
            self.probe.set_enabled(plan.attention)
            if plan.attention:
                self.probe.reset()
        t1 = time.perf_counter()
        status = self.ctx.decode_batch(toks, pos, seqs, want)
        t2 = time.perf_counter()
        self.steps += 1
        self.step_tokens += len(toks)
        self.step_s += t2 - t1
        if status != 0:
            err = NativeError(f"llama_decode failed (status {status}) on a batch of {len(toks)} tokens")
            for req, _ in rows:
                self._release(req, exc=err)
            return
        for req, row in rows:
            try:
                self._advance(req, row)
            except BaseException as exc:
                self._release(req, exc=exc)
        self.host_s += (t1 - t0) + (time.perf_counter() - t2)

    def _advance(self, req: _Request, row: int) -> None:
        run = req.run
        if req.prefilling:
            a, b = req.chunks[req.next_chunk]
            run.after_chunk(a, b)
            req.next_chunk += 1
            if req.prefilling:
                return
            run.end_prefill()
        else:
            run.after_token()
        req.token = run.next_token(self.ctx.logits(row))
        if req.token is None:
            self._release(req)
