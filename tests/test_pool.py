"""The slot pool (continuous batching in one persistent context) on the real Gemma 3 270M.

Oracles: upstream llama.cpp's own multi-stream cache (a Full KV pool) for the layered pool at full
capacity, logits bit for bit under the same batches; and a request's own logits, which must not
change when the requests beside it change (same prompt length, other tokens), under eviction.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO

from pask_local.chat.decoder import Decoder
from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.engine.pool import RequestCancelled, SlotPool
from pask_local.errors import PaskError
from pask_local.llm import Context, ContextConfig, Model
from pask_local.messages import user_message
from pask_local.schema.tools import read_tools

pytestmark = pytest.mark.slow

WEATHER = read_tools(REPO / "examples" / "get_weather.json")
CITIES = ["Paris", "Rome", "Berlin", "Madrid", "Tokyo", "London", "Vienna", "Oslo"]


@pytest.fixture(scope="module")
def model(gemma_model) -> Model:
    return gemma_model


class Recorder(Decoder):
    """The engine's decoder, keeping a copy of the logits of every step."""

    def __init__(self, model: Model, plan, log: list[np.ndarray]) -> None:
        super().__init__(model, plan)
        self.log = log

    def choose(self, logits: np.ndarray) -> int:
        self.log.append(np.array(logits, copy=True))
        return super().choose(logits)


def engine(model, method, budget, log=None, max_tokens=40):
    factory = Decoder if log is None else (lambda m, p, s: Recorder(m, p, log))
    return Engine(model, make_method(method, model), EngineConfig(budget=budget, max_tokens=max_tokens),
                  decoder_factory=factory)


def ask(city: str) -> str:
    return f"What is the weather like in {city} today? Answer in celsius."


def run_pool(model, method, budget, questions, slots=None, slot_len=512, logs=True):
    """Submit every question before the loop starts (one admission: reproducible batches)."""
    lay = SlotPool.layout_for(model, make_method(method, model), budget, slot_len, slots=slots or len(questions))
    pool = SlotPool(model, lay, start=False, prefix_cache=False)
    try:
        records = [[] for _ in questions]
        futures = []
        for q, rec in zip(questions, records, strict=True):
            e = engine(model, method, budget, rec if logs else None)
            futures.append(pool.submit(e, e.prepare(user_message(q), WEATHER, "required")))
        pool.start()
        return [f.result(timeout=300) for f in futures], records, pool
    finally:
        pool.close()


def same_length_cities(model, n):
    e = engine(model, "full", 1.0)
    lens = {c: e.prepare(user_message(ask(c)), WEATHER, "required").n_prompt for c in CITIES}
    base = lens[CITIES[0]]
    same = [c for c in CITIES if lens[c] == base]
    assert len(same) >= n, f"need {n} cities whose prompts tokenize to {base} tokens: {lens}"
    return same[:n]


def test_layered_pool_at_full_capacity_equals_upstream_pool(model):
    qs = [ask("Paris"), "Put a team meeting in my calendar for 2025-03-14 at 10:00.", ask("Rome")]
    up, up_logs, up_pool = run_pool(model, "full", 1.0, qs)
    lay, lay_logs, lay_pool = run_pool(model, "pask-prior", 1.0, qs)
    assert up_pool.layout.full and not lay_pool.layout.full
    assert lay_pool.layout.capacities == up_pool.layout.capacities  # same cells per stream
    for a, b, la, lb in zip(up, lay, up_logs, lay_logs, strict=True):
        assert a.tokens == b.tokens
        assert len(la) == len(lb) > 0
        for x, y in zip(la, lb, strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("method", ["pask-prior", "h2o", "tova"])
def test_a_request_does_not_see_its_neighbours(model, method):
    """H2O and TOVA rank by attention every step: each slot's statistics come from its own stream
    (summed over the batch's streams, copies would still agree but different neighbours would not)."""
    a, b, c = same_length_cities(model, 3)
    alone, alone_logs, _ = run_pool(model, method, 0.33, [ask(a)] * 3)
    mixed, mixed_logs, pool = run_pool(model, method, 0.33, [ask(a), ask(b), ask(c)])
    # three copies of one request in three streams: three identical replies
    assert alone[0].tokens == alone[1].tokens == alone[2].tokens
    for x, y in zip(alone_logs[0], mixed_logs[0], strict=True):
        np.testing.assert_array_equal(x, y)
    assert mixed[0].tokens == alone[0].tokens
    for r in mixed:
        assert r.ok and r.calls[0]["name"] == "get_weather", r.text
        assert r.stats["max_over_budget_entries"] <= 0
        assert r.stats["budget_used_final"] <= 0.33 + 0.01
        assert r.stats["kv_bytes_allocated"] == pool.slot_bytes
    assert mixed[1].tokens != mixed[0].tokens or mixed_logs[1][0].tobytes() != mixed_logs[0][0].tobytes()


def test_more_requests_than_slots_and_a_cancelled_one(model):
    lay = SlotPool.layout_for(model, make_method("streaming", model), 0.33, 512, slots=2)
    pool = SlotPool(model, lay, start=False, prefix_cache=False)
    try:
        futures = []
        for i, city in enumerate(CITIES[:5]):
            e = engine(model, "streaming", 0.33)
            cancelled = (lambda: True) if i == 1 else (lambda: False)
            futures.append(pool.submit(e, e.prepare(user_message(ask(city)), WEATHER, "required"),
                                       cancelled=cancelled))
        pool.start()
        with pytest.raises(RequestCancelled):
            futures[1].result(timeout=300)
        results = [f.result(timeout=300) for i, f in enumerate(futures) if i != 1]
        assert all(r.ok and r.calls for r in results), [r.text for r in results]
        assert pool.busy == 0 and pool.waiting == 0
        for il in range(model.n_layer):  # every stream is empty again
            assert all(pool.ctx.used(il, s) == 0 for s in range(2))
        assert pool.stats()["tokens_per_step"] > 1.0  # steps did batch several sequences
    finally:
        pool.close()


def test_prefill_room_per_step_is_held(model):
    lay = SlotPool.layout_for(model, make_method("pask-prior", model), 0.33, 512, slots=3)
    pool = SlotPool(model, lay, start=False, prefill_tokens=64, prefix_cache=False)
    try:
        futures = []
        for city in CITIES[:3]:
            e = engine(model, "pask-prior", 0.33)
            futures.append(pool.submit(e, e.prepare(user_message(ask(city)), WEATHER, "required")))
        pool.start()
        assert all(f.result(timeout=300).ok for f in futures)
        assert 0 < pool.stats()["max_prompt_tokens_per_step"] <= 64
    finally:
        pool.close()
    unlimited, _, pool = run_pool(model, "pask-prior", 0.33, [ask(c) for c in CITIES[:3]], logs=False)
    assert pool.stats()["max_prompt_tokens_per_step"] > 64  # without the room, chunks of all three


def test_the_prompt_closest_to_done_gets_the_prefill_room_first(model):
    """One step carries at most 64 prompt tokens: a short prompt admitted after a long one is read
    first (least prompt left), so its first token comes before the long one's."""
    lay = SlotPool.layout_for(model, make_method("pask-prior", model), 0.33, 1024, slots=2)
    pool = SlotPool(model, lay, start=False, prefill_tokens=64, prefix_cache=False)
    order: list[str] = []
    try:
        filler = " ".join(f"Note {i}: the office plant needs water on day {i}." for i in range(30))
        futures = []
        for name, q in (("long", filler + " " + ask("Paris")), ("short", ask("Rome"))):
            e = engine(model, "pask-prior", 0.33)
            futures.append(pool.submit(e, e.prepare(user_message(q), WEATHER, "required"),
                                       on_token=lambda _t, n=name: order.append(n)))
        pool.start()
        long_r, short_r = (f.result(timeout=300) for f in futures)
    finally:
        pool.close()
    assert short_r.ok, short_r.text  # (the base model may ramble on the long one: only its order matters)
    assert long_r.stats["n_gen"] > 0
    assert long_r.stats["n_prompt"] > short_r.stats["n_prompt"] + 128
    assert order[0] == "short"


def test_stop_from_the_token_hook_frees_the_slot(model):
    lay = SlotPool.layout_for(model, make_method("pask-prior", model), 0.33, 512, slots=1)
    pool = SlotPool(model, lay)
    try:
        e = engine(model, "pask-prior", 0.33)
        seen = []
        r = pool.execute(e, e.prepare(user_message(ask("Oslo")), WEATHER, "required"),
                         on_token=lambda t: seen.append(t) or len(seen) >= 3)
        assert r.finish == "cancelled" and len(r.tokens) == 3
        e2 = engine(model, "pask-prior", 0.33)
        r2 = pool.execute(e2, e2.prepare(user_message(ask("Oslo")), WEATHER, "required"))
        assert r2.ok and r2.tokens[:3] == r.tokens
    finally:
        pool.close()


def test_equal_memory_gives_a_compressed_method_more_slots(model):
    kv_mem = 64 << 20
    full = SlotPool.layout_for(model, make_method("full", model), 1.0, 2048, kv_mem=kv_mem)
    pask = SlotPool.layout_for(model, make_method("pask-prior", model), 0.33, 2048, kv_mem=kv_mem)
    assert pask.slots >= 2 * full.slots >= 2
    for lay in (full, pask):
        pool = SlotPool(model, lay)
        try:
            assert pool.kv_bytes <= kv_mem
            assert pool.kv_bytes + pool.slot_bytes > kv_mem  # one more slot would not fit
        finally:
            pool.close()


def test_requests_the_pool_cannot_run_are_refused_before_they_wait(model):
    lay = SlotPool.layout_for(model, make_method("pask-prior", model), 0.33, 256, slots=1)
    pool = SlotPool(model, lay)
    try:
        q = user_message(ask("Paris"))
        for method, budget, needle in [("full", 1.0, "--method full"), ("pask-prior", 0.5, "above this pool")]:
            e = engine(model, method, budget)
            with pytest.raises(PaskError, match=needle):
                pool.submit(e, e.prepare(q, WEATHER, "required"))
        e = engine(model, "pask-prior", 0.33, max_tokens=200)
        with pytest.raises(PaskError, match="exceed a slot"):
            pool.submit(e, e.prepare(q, WEATHER, "required"))
        with pytest.raises(PaskError, match="holds no slot"):
            SlotPool.layout_for(model, make_method("full", model), 1.0, 2048, kv_mem=1 << 20)
    finally:
        pool.close()
    # a method that prefills the whole prompt first needs the whole prompt to fit a slot's cells
    lay = SlotPool.layout_for(model, make_method("pask-prior", model), 0.1, 2048, slots=1)
    pool = SlotPool(model, lay)
    try:
        filler = " ".join(f"Note {i}: the office plant needs water on day {i}." for i in range(45))
        e = engine(model, "snapkv", 0.1)
        p = e.prepare(user_message(filler + " " + ask("Paris")), WEATHER, "required")
        assert p.n_prompt > pool.whole_prompt_room == 512
        with pytest.raises(PaskError, match="prefills the whole prompt before it compresses: a slot of this pool "
                                            "holds 512 prompt tokens at once"):
            pool.submit(e, p)
    finally:
        pool.close()


def _b_after_a(model, reuse: str):
    """A Full KV pool of one slot with ``reuse``: request A (Paris), then B (Berlin) whose prompt shares
    A's beginning; (a, b, A's prepared, B's prepared, B's logits log, the closed pool)."""
    lay = SlotPool.layout_for(model, make_method("full", model), 1.0, 512, slots=1)
    pool = SlotPool(model, lay, reuse=reuse)
    log: list = []
    try:
        ea = engine(model, "full", 1.0)
        pa = ea.prepare(user_message(ask("Paris")), WEATHER, "required")
        a = pool.execute(ea, pa)
        eb = engine(model, "full", 1.0, log)
        pb = eb.prepare(user_message(ask("Berlin") + " Thanks."), WEATHER, "required")
        b = pool.execute(eb, pb)
    finally:
        pool.close()
    return a, b, pa, pb, log, pool


def test_a_cached_prefix_is_what_upstream_holds_after_the_same_operations(model):
    """Full KV pool, one slot: B after A reuses their common prefix; upstream, doing what the pool
    does (A's prompt in chunks, A's tokens, drop from the common prefix on, B's rest in chunks),
    gives B's first logits bit for bit."""
    a, b, pa, pb, log, pool = _b_after_a(model, "any")
    ta, tb = pa.plan.prompt.tokens, pb.plan.prompt.tokens
    r = b.stats["prefix_reused"]
    assert 32 <= r < len(tb) and ta[:r] == tb[:r] and ta[r] != tb[r]
    assert pool.stats()["reused_prompt_tokens"] == r
    ctx = Context(model, ContextConfig(n_ctx=512, n_batch=64))
    try:
        for i in range(0, len(ta), 64):
            assert ctx.decode(ta[i:i + 64], i) == 0
        n_gen = a.stats["n_gen"] - (1 if a.finish == "grammar" else 0)  # the last token was not decoded
        for k, t in enumerate(a.tokens[:n_gen]):
            assert ctx.decode([t], len(ta) + k) == 0
        ctx.seq_rm(0, r, -1)
        for i in range(r, len(tb), 64):
            assert ctx.decode(tb[i:i + 64], i) == 0
        np.testing.assert_array_equal(ctx.logits(), log[0])
    finally:
        ctx.close()


def test_a_compressed_prefix_is_reused_within_the_budget(model):
    lay = SlotPool.layout_for(model, make_method("pask-prior", model), 0.33, 512, slots=1)
    pool = SlotPool(model, lay, reuse="any")  # (the exact mode reuses no compressed prefix)
    try:
        first = []
        for city in ("Paris", "Rome", "Paris"):
            e = engine(model, "pask-prior", 0.33)
            first.append(pool.execute(e, e.prepare(user_message(ask(city)), WEATHER, "required")))
    finally:
        pool.close()
    assert first[0].stats["prefix_reused"] == 0
    for i, r in enumerate(first):
        assert (r.stats["prefix_reused"] >= 32) == (i > 0)
        assert r.ok and r.calls[0]["name"] == "get_weather", r.text
        assert r.stats["max_over_budget_entries"] <= 0
        # pask-prior plans its prompt: what a prefill leaves is the plan, no chunk of slack
        assert r.stats["budget_used_after_prefill"] <= 0.33 + 1 / r.stats["n_prompt"]


def test_no_reuse_after_a_sliding_window_moved_on(model):
    """Gemma's sliding-window layers (512) dropped what left the window of a long request: a prompt
    sharing its beginning must not start from that stream."""
    lay = SlotPool.layout_for(model, make_method("full", model), 1.0, 1024, slots=1)
    pool = SlotPool(model, lay)
    try:
        filler = " ".join(f"Note {i}: the office plant needs water on day {i}." for i in range(45))
        results = []
        for city in ("Paris", "Rome"):
            e = engine(model, "full", 1.0)
            results.append(pool.execute(e, e.prepare(user_message(filler + " " + ask(city)), WEATHER, "required")))
    finally:
        pool.close()
    assert results[0].stats["n_prompt"] > 512 and results[1].ok
    assert results[1].stats["prefix_reused"] == 0


def test_exact_reuse_equals_a_fresh_prefill(model):
    """Full KV pool, one slot, the default (exact) reuse: B after A starts from their common prefix cut
    to a multiple of the chunk, and B's first logits equal upstream's fresh prefill of B alone (its
    prompt in chunks of 64 from 0), bit for bit."""
    _, b, pa, pb, log, _ = _b_after_a(model, "exact")
    ta, tb = pa.plan.prompt.tokens, pb.plan.prompt.tokens
    r = b.stats["prefix_reused"]
    shared = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
    assert r >= 64 and r % 64 == 0 and r <= shared < r + 64
    ctx = Context(model, ContextConfig(n_ctx=512, n_batch=64))
    try:
        for i in range(0, len(tb), 64):
            assert ctx.decode(tb[i:i + 64], i) == 0
        np.testing.assert_array_equal(ctx.logits(), log[0])
    finally:
        ctx.close()


def test_exact_reuse_takes_no_compressed_prefix(model):
    """The default reuse: a method that evicts while it reads starts every request from a fresh stream,
    so the same request gives the same first logits after another one (as with no cache at all)."""
    lay = SlotPool.layout_for(model, make_method("pask-prior", model), 0.33, 512, slots=1)
    pool = SlotPool(model, lay)
    logs = []
    try:
        for city in ("Paris", "Rome", "Paris"):
            log: list = []
            e = engine(model, "pask-prior", 0.33, log)
            r = pool.execute(e, e.prepare(user_message(ask(city)), WEATHER, "required"))
            assert r.stats["prefix_reused"] == 0
            logs.append((log, r.tokens))
    finally:
        pool.close()
    assert pool.stats()["reused_prompt_tokens"] == 0
    np.testing.assert_array_equal(logs[0][0][0], logs[2][0][0])
    assert logs[0][1] == logs[2][1]


def test_a_scoring_pass_runs_beside_the_decoding_slots(model, monkeypatch):
    """A request whose method declares a scoring pass (knorm) has it run off the loop's thread: while
    the pass runs, the request already decoding goes on producing tokens; the scored request is then
    admitted and answers within its budget. (With the pass on the loop's thread, the decoding request
    could not move until the pass returned: the pass below would wait for it in vain.)"""
    import threading
    import time

    from pask_local.engine import prescore

    real = prescore.SCORERS["key-norm"]
    a_tokens: list[int] = []
    moved: list[int] = []

    def watched(m, method, prefix, cfg):
        out = real(m, method, prefix, cfg)
        n0, deadline = len(a_tokens), time.monotonic() + 30
        while len(a_tokens) < n0 + 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        moved.append(len(a_tokens) - n0)
        return out

    monkeypatch.setitem(prescore.SCORERS, "key-norm", watched)
    # an earlier test's pass over the same prefix would be served from the memo, without a pass to watch
    monkeypatch.setattr(prescore, "_MEMO", type(prescore._MEMO)())
    lay = SlotPool.layout_for(model, make_method("pask-prior", model), 0.33, 1024, slots=2)
    pool = SlotPool(model, lay, prefix_cache=False)
    try:
        first = threading.Event()
        a = engine(model, "pask-prior", 0.33, max_tokens=200)
        fa = pool.submit(a, a.prepare(user_message("Tell me a long story about a cat and a dog."), []),
                         on_token=lambda t: a_tokens.append(t) or first.set() or False)
        assert first.wait(120)
        b = engine(model, "knorm", 0.33)
        rb = pool.submit(b, b.prepare(user_message(ask("Rome")), WEATHER, "required")).result(timeout=300)
        ra = fa.result(timeout=300)
    finally:
        pool.close()
    assert moved and moved[0] >= 3, moved  # the decoding request moved while the pass ran
    assert ra.ok and len(ra.tokens) > moved[0]
    assert rb.ok and rb.calls and rb.stats["max_over_budget_entries"] == 0
