"""Continuous batching: many requests decoded together in one persistent llama context.

``SlotPool`` owns one context whose KV memory is fixed when it starts: ``slots`` sequences, each
its own KV stream, every layer of a stream a fixed number of cells (Full KV: the slot length; a
compressed method: budget x slot length + one prefill chunk, rounded up to 256 cells, sliding-window
layers at most their window + a chunk). ``SlotPool.for_kv_memory`` derives the slot count from a
memory size, so that at equal memory a budget of 0.33 gets about three times the slots of Full KV.

One thread runs the step loop. Each step is one ``llama_decode`` that holds the next token of every
decoding sequence and the next prompt chunk of the sequences still prefilling (those with the
least prompt left first, within ``prefill_tokens``), in sequence-id order (upstream splits a
multi-stream batch into ubatches of consecutive sequences, so a request takes the lowest free id).
After it, each sequence's own run (``Engine.start_in_slot``: its method, its native persistence
step on its sequence id, its grammar) evicts and chooses its next token from its own logits row. ``execute`` blocks its caller until the request is answered; a
request waits for a free slot in arrival order; one whose ``cancelled`` turns true (a client that
went away: checked every step, prefill included) or whose token hook asks to stop frees its slot
at the next step. A failed decode fails the requests in that batch and clears their sequences;
the pool goes on serving.

The prefix cache is exact by default: a request starts from another request's stream only where
that equals its own fresh prefill. So the reused prefix must be held whole (never compressed under
the other request) and the request's method must read a prefix with full attention (Full KV, or a
method that compresses only after the whole prompt); the reuse ends at a multiple of the chunk, so
the rest is read in the same chunks as a fresh prefill. ``reuse="any"`` also lets methods that evict
while they read (pask, streaming, h2o, ...) start from what another request's run kept, and reuses
the whole common prefix: faster, but the output may then differ from a fresh run.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..attention import LAST, SUM, WINDOW, AttentionProbe
from ..errors import NativeError, PaskError
from ..kv_layered import LayeredContext, kv_total_bytes
from ..llm import Context, ContextConfig, Model
from ..methods import Method
from ..model_info import swa_layers
from .core import (
    Engine,
    EngineConfig,
    EngineResult,
    Prepared,
    SlotSpec,
    TokenHook,
    kv_type_id,
    prefills_whole,
    round_up,
)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


REUSE_MODES = ("exact", "any")  # prefix reuse: only where it equals a fresh prefill, or any held prefix


class PoolClosed(PaskError):
    """The pool is shutting down."""


class RequestCancelled(PaskError):
    """The request was cancelled before its first token."""


@dataclass
class PoolLayout:
    """What a pool allocates: cells per layer of one slot, and the slot count."""

    full: bool                 # an upstream cache (Full KV) instead of the layered one
    capacities: list[int]      # cells per layer in each slot's stream
    slots: int
    slot_len: int              # prompt + max_tokens one slot holds
    budget: float              # the largest budget a request may ask for (1.0: Full KV)
    kv_type: str = "f16"       # K/V element type (quantized: flash attention on)


def slot_capacities(model: Model, method: Method, budget: float, slot_len: int, chunk: int) -> list[int]:
    """Cells per layer of one slot for ``method`` at ``budget`` (see the module doc)."""
    swa, window = swa_layers(model)
    full = round_up(slot_len)
    if method.keeps_all:
        return [full] * model.n_layer
    need = min(slot_len, math.ceil(budget * slot_len) + chunk)
    caps = []
    for il in range(model.n_layer):
        c = min(need, window + chunk) if (il in swa and window > 0) else need
        caps.append(min(round_up(c), full))
    return caps


@dataclass
class _Request:
    engine: Engine
    prepared: Prepared
    on_token: TokenHook | None
    cancelled: Callable[[], bool]
    trace: str | Path | None = None  # a JSONL trace path for this request (as ``pask-local run --trace``)
    future: Future[EngineResult] = field(default_factory=Future)
    run: Any = None            # the engine's run once admitted
    seq: int = -1
    chunks: list[tuple[int, int]] = field(default_factory=list)
    next_chunk: int = 0
    token: int | None = None   # the token to decode next (decoding phase)
    admitted_at: float = 0.0

    @property
    def prefilling(self) -> bool:
        """Prompt chunks are still to decode."""
        return self.next_chunk < len(self.chunks)


class SlotPool:
    """One persistent context serving up to ``layout.slots`` requests at once."""

    def __init__(self, model: Model, layout: PoolLayout, chunk: int = EngineConfig.chunk,
                 flash_attn: bool = False, start: bool = True, prefill_tokens: int = 0,
                 prefix_cache: bool = True, min_reuse: int = 32, reuse: str = "exact") -> None:
        """``start=False``: requests queue until ``start()`` (all admitted together: reproducible batches).

        ``prefill_tokens``: prompt tokens one step may carry (the prefilling requests with the least
        prompt left first, at least one chunk), which bounds how much a prefill slows the decoding
        slots; 0: a chunk for every prefilling request. ``prefix_cache``: a finished request's stream keeps its KV; a new
        request whose prompt starts with at least ``min_reuse`` of the same tokens takes that slot and
        prefills only the rest (what the earlier request's method kept of the prefix is what it gets)."""
        if layout.slots < 1:
            raise PaskError(f"a pool needs at least one slot, got {layout.slots}")
        self.model = model
        self.layout = layout
        self.chunk = chunk
        self.prefill_tokens = prefill_tokens
        self.prefix_cache = prefix_cache
        self.min_reuse = max(1, min_reuse)
        if reuse not in REUSE_MODES:
            raise PaskError(f"unknown prefix reuse mode {reuse!r} ({', '.join(REUSE_MODES)})")
        self.reuse = reuse
        self._held_tokens: dict[int, list[int]] = {}  # free seq -> the tokens its stream still holds
        swa, window = swa_layers(model)
        self._swa = set(swa) if window > 0 else set()  # sliding-window layers
        self._window = window
        # a sliding-window layer drops positions that left its window: a stream that ran past it no
        # longer holds the window a new request at the shared prefix's end needs
        self.reuse_limit = window if self._swa else None
        self.reused_tokens = 0                          # prompt tokens not prefilled thanks to the cache
        self.shared_tokens = 0                          # of those, copied from a running request's stream
        n_batch = layout.slots * chunk
        flash_attn = flash_attn or layout.kv_type != "f16"  # a quantized V cache needs flash attention
        kv = kv_type_id(layout.kv_type)
        cfg = ContextConfig(n_ctx=layout.slots * round_up(layout.slot_len), n_batch=n_batch,
                            n_seq_max=layout.slots, kv_unified=False, flash_attn=flash_attn, type_k=kv, type_v=kv)
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
        self._waiting: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._cond = threading.Condition()
        self._closed = False
        self.steps = 0                      # llama_decode calls
        self.step_tokens = 0                # tokens decoded in them
        self.max_prompt_step = 0            # most prompt tokens one step carried
        self.step_s = 0.0                   # time in llama_decode
        self.host_s = 0.0                   # time in the runs between decodes (sampling, tagging, eviction)
        self._thread = threading.Thread(target=self._loop, name="pask-pool", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        """Start the step loop (once)."""
        if not self._thread.is_alive() and not self._closed:
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
        kv = kv_type_id(kv_type)
        cfg = ContextConfig(n_ctx=round_up(slot_len), n_batch=EngineConfig.cell_align, n_seq_max=1, flash_attn=kv_type != "f16",
                            type_k=kv, type_v=kv)
        ctx: Context = Context(model, cfg) if full else LayeredContext(model, caps, cfg)
        try:
            return kv_total_bytes(ctx) if full else ctx.kv_bytes()
        finally:
            ctx.close()

    # ------------------------------------------------------------- public
    @property
    def busy(self) -> int:
        """Slots holding a request now."""
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

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
        if prefills_whole(method):
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
        """Queue a prepared request; its future holds the result (or the error). ``trace``: a JSONL
        trace of the request, as ``pask-local run --trace`` writes."""
        self.check(engine, prepared)
        req = _Request(engine, prepared, on_token, cancelled, trace=trace)
        with self._cond:
            if self._closed:
                raise PoolClosed("the pool is shutting down")
            self._waiting.append(req)
            self._cond.notify_all()
        return req.future

    def execute(self, engine: Engine, prepared: Prepared, on_token: TokenHook | None = None,
                cancelled: Callable[[], bool] = lambda: False) -> EngineResult:
        """Run a prepared request in the pool; blocks until it is answered (or fails)."""
        return self.submit(engine, prepared, on_token, cancelled).result()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the step loop (requests still running or waiting fail) and free the context."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        else:  # never started: fail what waits
            self._fail_all(PoolClosed("the pool is shutting down"))
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
    def _admit(self) -> None:
        deferred: deque[_Request] = deque()
        while self._waiting and self._free:
            req = self._waiting.popleft()
            if req.cancelled():
                req.future.set_exception(RequestCancelled("the request was cancelled before it started"))
                continue
            method = req.engine.method
            exact = method.keeps_all or prefills_whole(method)  # it reads a prefix with full attention
            if self.reuse == "exact":
                choice = self._pick_slot(req.prepared.plan.prompt.tokens, whole=True, aligned=True, reuse=exact)
            else:
                choice = self._pick_slot(req.prepared.plan.prompt.tokens, whole=prefills_whole(method))
            if choice is None:  # a running request is still prefilling the prefix it shares: wait for it
                deferred.append(req)
                continue
            seq, reuse, shared = choice
            spec = SlotSpec(self.ctx, seq, self.layout.capacities, self.slot_bytes, self.flash_attn, reuse,
                            self.layout.kv_type, compact=True, probe=self.probe,
                            reuse_source="running" if shared else ("cache" if reuse else ""))
            try:
                req.run = req.engine.start_in_slot(req.prepared, spec, req.on_token, trace=req.trace)
            except BaseException as exc:
                self.ctx.seq_rm(seq, -1, -1)
                self._free.append(seq)
                req.future.set_exception(exc)
                continue
            self.reused_tokens += reuse
            self.shared_tokens += reuse if shared else 0
            req.seq = seq
            req.chunks = req.run.prefill_bounds()
            req.admitted_at = time.perf_counter()
            self._active.append(req)
        self._waiting.extendleft(reversed(deferred))

    def _reusable(self, held_len: int) -> bool:
        """A stream that held ``held_len`` positions still has the window a prefix's end needs."""
        return self.reuse_limit is None or held_len <= self.reuse_limit

    def _running_source(self, tokens: list[int], whole: bool) -> tuple[_Request | None, int]:
        """The running request whose prompt shares the longest prefix with ``tokens``, and its length.
        ``whole``: only one whose stream still holds that prefix whole when it has read it (Full KV, or
        a whole-prompt method whose last chunk, where it compresses, starts after the prefix)."""
        best, best_n = None, 0
        if not self.prefix_cache:
            return best, best_n
        for r in self._active:
            if r.cancelled() or not self._reusable(r.run.n_seq):
                continue
            if whole and not (r.run.full or r.run.method.compress_after_prefill):
                continue
            n = common_prefix(list(r.run.prompt.tokens), tokens)
            if whole and not r.run.full and n > r.chunks[-1][0]:
                continue
            if n > best_n and self._reusable(n):
                best, best_n = r, n
        return best, best_n

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

    def _aligned(self, n: int, aligned: bool) -> int:
        """``n`` floored to a multiple of the chunk when ``aligned``: the rest is read in a fresh prefill's chunks."""
        return (n // self.chunk) * self.chunk if aligned else n

    def _pick_slot(self, tokens: list[int], whole: bool = False, aligned: bool = False,
                   reuse: bool = True) -> tuple[int, int, bool] | None:
        """A free sequence for a prompt, how many of its first tokens it holds, and whether they were
        copied from a running request; None: wait, a running request is still prefilling that prefix.

        The prefix comes from the free stream that holds the longest one (a finished request's), or, if
        a running request shares a longer one, from that request's stream: copied whole into the free
        stream, then cut at the shared length (what the running request's method kept of it so far).
        ``whole``: only a prefix held whole; ``aligned``: the prefix ends at a multiple of the chunk;
        ``reuse=False``: none (a fresh stream, the one with the least cached)."""
        want = tokens[:-1]  # the last prompt token is always decoded (its logits)
        best, best_n = -1, 0
        for seq in self._free if reuse else ():
            held = self._held_tokens.get(seq)
            if not held or not self._reusable(len(held)):
                continue
            n = self._aligned(common_prefix(held, want), aligned)
            if n > best_n and (not whole or self._holds_whole(seq, n)):
                best, best_n = seq, n
        src, src_n = self._running_source(want, whole) if reuse else (None, 0)
        src_n = self._aligned(src_n, aligned)
        copy_from = -1  # the running request's sequence whose stream is copied
        if src is not None and src_n >= self.min_reuse and src_n > best_n:
            # wait until the source decoded the shared prefix, and a step since its admission (a
            # stream copy is carried out by the next decode: the source's own must be done)
            if src.next_chunk == 0 or src.run.n_seq < src_n:
                return None
            if not whole or self._holds_whole(src.seq, src_n):  # (a whole-prompt source may have compressed)
                copy_from = src.seq
        if copy_from >= 0:
            # a free stream that holds no cached prefix, else the lowest
            best = min(self._free, key=lambda s: (s in self._held_tokens, s))
            best_n = src_n
        elif best_n < self.min_reuse:
            best, best_n = min(self._free), 0
        self._free.remove(best)
        self._held_tokens.pop(best, None)
        if copy_from >= 0:
            self.ctx.seq_rm(best, -1, -1)
            self.ctx.seq_cp(copy_from, best)  # the data moves at the next decode, before its graph runs
        self.ctx.seq_rm(best, best_n, -1)  # the rest of the earlier request (all of it without reuse)
        return best, best_n, copy_from >= 0

    def _release(self, req: _Request, result: EngineResult | None = None, exc: BaseException | None = None) -> None:
        self._active.remove(req)
        try:
            if result is None and exc is None:
                try:
                    result = req.run.result()
                except BaseException as e:  # a reply that cannot be built is that request's failure
                    exc = e
            req.run.close()
        finally:
            run = req.run
            if self.prefix_cache and exc is None and run.n_seq > 0:
                self._held_tokens[req.seq] = (list(run.prompt.tokens) + run.out)[:run.n_seq]
            else:
                self.ctx.seq_rm(req.seq, -1, -1)
            self._free.append(req.seq)
        if exc is not None:
            req.future.set_exception(exc)
        else:
            req.future.set_result(result)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self._active:
                    self._cond.wait()
                if self._closed:
                    break
                self._admit()
            if self._active:
                self._step()
        self._fail_all(PoolClosed("the server is shutting down"))

    def _fail_all(self, err: BaseException) -> None:
        for req in list(self._active):
            self._release(req, exc=err)
        with self._cond:
            for req in self._waiting:
                req.future.set_exception(err)
            self._waiting.clear()

    def _step(self) -> None:
        """One llama_decode for every active request, then each request's own bookkeeping."""
        t0 = time.perf_counter()
        toks: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        want: list[bool] = []
        rows: list[tuple[_Request, int]] = []   # (request, its logits row or -1)
        n_prompt_toks = 0
        # the least prompt left first (then the oldest): a request that starts from a reused prefix
        # is not held behind a long prefill for the prefill room of many steps
        prefilling = sorted((r for r in self._active if r.prefilling),
                            key=lambda r: (r.run.n_prompt - r.chunks[r.next_chunk][0], r.admitted_at))
        room = self.prefill_tokens or len(prefilling) * self.chunk
        fed: set[int] = set()
        # a request whose observation window is its prompt's last chunk gets a step of its own: upstream
        # splits a batch into ubatches of equal tokens per sequence, and the window statistic counts
        # the last queries of each ubatch, so the chunk must be one ubatch
        solo = next((r for r in prefilling if self._reads_window_now(r)), None)
        for r in prefilling if solo is None else [solo]:
            a, b = r.chunks[r.next_chunk]
            if fed and b - a > room:
                break
            fed.add(id(r))
            room -= b - a
        for req in sorted(self._active, key=lambda r: r.seq):
            if req.cancelled():
                if req.prefilling:  # no reply to build
                    self._release(req, exc=RequestCancelled("the request was cancelled while its prompt was read"))
                else:
                    req.run.finish = "cancelled"
                    self._release(req)
                continue
            run = req.run
            if solo is not None and req is not solo:
                continue
            if req.prefilling:
                if id(req) not in fed:  # waits for a later step's prefill room
                    continue
                a, b = req.chunks[req.next_chunk]
                last = req.next_chunk == len(req.chunks) - 1
                for p in range(a, b):
                    toks.append(run.prompt.tokens[p])
                    pos.append(p)
                    seqs.append(req.seq)
                    want.append(last and p == b - 1)
                n_prompt_toks += b - a
            else:
                toks.append(req.token)
                pos.append(run.pos)
                seqs.append(req.seq)
                want.append(True)
            rows.append((req, len(toks) - 1 if want[-1] else -1))
        if not rows:
            return
        self.max_prompt_step = max(self.max_prompt_step, n_prompt_toks)
        if self.probe is not None:  # statistics only in steps that a running request reads
            scoring = any(req.run.scores_each_decode or self._reads_window_now(req) for req, _ in rows)
            self.probe.set_enabled(scoring)
            if scoring:
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

    @staticmethod
    def _reads_window_now(req: _Request) -> bool:
        """The request's next chunk is its prompt's last and its method reads that chunk's window."""
        run = req.run
        return (run.needs_attn and run.method.compress_after_prefill and req.prefilling
                and req.next_chunk == len(req.chunks) - 1)

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
