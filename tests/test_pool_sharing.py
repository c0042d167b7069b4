"""Prefix sharing between running requests in the slot pool, on the real Gemma 3 270M.

A request whose prompt shares its beginning with a request still running waits until that request
has decoded the shared part, then starts from a copy of its stream cut at the shared length.
Oracles: upstream llama.cpp on one sequence doing the same operations (the first prompt in chunks,
drop from the shared length on, the rest of the second prompt in chunks), and upstream's own
multi-stream cache (a Full KV pool) for the layered pool at full capacity, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_pool import WEATHER, ask, engine

from pask_local.engine import make_method
from pask_local.engine.pool import RequestCancelled, SlotPool
from pask_local.llm import Context, ContextConfig, Model
from pask_local.messages import user_message

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(gemma_model) -> Model:
    return gemma_model


def submit_all(model, method, budget, questions, slots, cancelled=None):
    """Submit every question before the loop starts (reproducible batches); results, logs, pool."""
    lay = SlotPool.layout_for(model, make_method(method, model), budget, 512, slots=slots)
    pool = SlotPool(model, lay, start=False, reuse="any")  # the whole common prefix, compressed ones too
    logs = [[] for _ in questions]
    futures, prepared = [], []
    try:
        for i, (q, log) in enumerate(zip(questions, logs, strict=True)):
            e = engine(model, method, budget, log)
            p = e.prepare(user_message(q), WEATHER, "required")
            prepared.append(p)
            futures.append(pool.submit(e, p, cancelled=(cancelled or {}).get(i, lambda: False)))
        pool.start()
        results = []
        for f in futures:
            try:
                results.append(f.result(timeout=300))
            except RequestCancelled as exc:
                results.append(exc)
        return results, logs, prepared, pool
    finally:
        pool.close()


def upstream_first_logits(model, first: list[int], second: list[int], shared: int, cuts: list[int],
                          chunk: int = 64) -> np.ndarray:
    """Upstream on one sequence: ``first`` in chunks up to the chunk that covers ``shared``, drop from
    ``shared`` on, then ``second``'s rest in the decodes that ``cuts`` bound: its last token's logits."""
    ctx = Context(model, ContextConfig(n_ctx=512, n_batch=chunk))
    try:
        for i in range(0, shared, chunk):
            assert ctx.decode(first[i:i + chunk], i) == 0
        ctx.seq_rm(0, shared, -1)
        bounds = [shared, *cuts, len(second)]
        for x, y in zip(bounds[:-1], bounds[1:], strict=True):
            assert ctx.decode(second[x:y], x) == 0
        return ctx.logits()
    finally:
        ctx.close()


def test_a_second_request_starts_from_the_running_ones_prefix_as_upstream_would(model):
    """Full KV pool, two slots, two requests with one tool list at once: the second waits for the
    first to decode their shared prefix, copies it and prefills only its own rest; its first logits
    are upstream's, bit for bit, after the same operations on one sequence. The rest (< 64 tokens)
    is decoded in the step that also carries the first request's first generated token, and upstream
    splits such a batch into ubatches of equal tokens per sequence: its first token, then the others."""
    qs = [ask("Paris"), ask("Berlin") + " Thanks."]
    (a, b), (log_a, log_b), (pa, pb), pool = submit_all(model, "full", 1.0, qs, slots=2)
    ta, tb = pa.plan.prompt.tokens, pb.plan.prompt.tokens
    r = b.stats["prefix_reused"]
    assert b.stats["prefix_source"] == "running" and a.stats["prefix_reused"] == 0
    assert 32 <= r < len(tb) and ta[:r] == tb[:r] and ta[r] != tb[r]
    assert len(tb) - r < 64 and len(ta) // 64 == r // 64  # the shapes the docstring's batches assume
    assert pool.stats()["shared_prompt_tokens"] == pool.stats()["reused_prompt_tokens"] == r
    assert a.ok and b.ok and a.calls and b.calls, (a.text, b.text)
    np.testing.assert_array_equal(log_b[0], upstream_first_logits(model, ta, tb, r, [r + 1]))
    # the first request's own prompt was decoded alone
    np.testing.assert_array_equal(log_a[0], upstream_first_logits(model, ta, ta, 0, []))


def test_layered_pool_at_full_capacity_shares_as_upstreams_pool(model):
    """The same three requests (one tool list) in a Full KV pool and in the layered pool at budget
    1.0: with sharing, every reply and every logit row bit for bit (upstream copies its streams)."""
    qs = [ask("Paris"), ask("Rome"), "Put a team meeting in my calendar for 2025-03-14 at 10:00."]
    up, up_logs, _, up_pool = submit_all(model, "full", 1.0, qs, slots=3)
    lay, lay_logs, _, lay_pool = submit_all(model, "pask-prior", 1.0, qs, slots=3)
    assert up_pool.layout.full and not lay_pool.layout.full
    assert [r.stats["prefix_source"] for r in up] == ["", "running", "running"]
    assert up_pool.stats()["shared_prompt_tokens"] == lay_pool.stats()["shared_prompt_tokens"] > 64
    for a, b, la, lb in zip(up, lay, up_logs, lay_logs, strict=True):
        assert a.tokens == b.tokens and a.stats["prefix_reused"] == b.stats["prefix_reused"]
        assert len(la) == len(lb) > 0
        for x, y in zip(la, lb, strict=True):
            np.testing.assert_array_equal(x, y)


def test_a_compressed_running_prefix_is_shared_within_the_budget(model):
    qs = [ask(c) for c in ("Paris", "Rome", "Oslo")]
    results, _, _, pool = submit_all(model, "pask-prior", 0.33, qs, slots=3)
    assert [r.stats["prefix_source"] for r in results] == ["", "running", "running"]
    assert pool.stats()["shared_prompt_tokens"] == sum(r.stats["prefix_reused"] for r in results)
    for r in results:
        assert r.ok and r.calls[0]["name"] == "get_weather", r.text
        assert r.stats["max_over_budget_entries"] <= 0
        assert r.stats["budget_used_after_prefill"] <= 0.33 + 1 / r.stats["n_prompt"]


def test_a_request_waiting_for_a_cancelled_source_is_still_served(model):
    calls = [0]

    def cancel_soon() -> bool:  # the first request goes away while its prompt is read
        calls[0] += 1
        return calls[0] > 3

    qs = [ask("Paris"), ask("Rome")]
    results, _, _, pool = submit_all(model, "full", 1.0, qs, slots=2, cancelled={0: cancel_soon})
    assert isinstance(results[0], RequestCancelled)
    b = results[1]
    assert b.ok and b.calls[0]["name"] == "get_weather", b.text
    assert pool.busy == 0 and pool.waiting == 0
