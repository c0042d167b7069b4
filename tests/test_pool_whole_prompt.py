"""Methods that prefill the whole prompt before compressing it (SnapKV, PyramidKV, pask-attn) in the
slot pool, on the real Gemma 3 270M.

Oracle: the method run alone (``Engine.execute``: its own context, its own prefill). In a pool slot the
prompt must give the same first-token logits bit for bit and the same compression (the positions
every layer evicts right after the prompt: the trace's step -1 records), with its prompt's last chunk
(the observation window) decoded in a step of its own, also while other requests decode beside it.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import compression
from test_pool import CITIES, WEATHER, ask, engine, same_length_cities

from pask_local.engine import make_method
from pask_local.engine.pool import SlotPool
from pask_local.llm import Model
from pask_local.messages import user_message

pytestmark = pytest.mark.slow

SLOT_LEN = 1024  # a slot's cells (0.33 x 1024 + a chunk, rounded to 512) hold these prompts whole


@pytest.fixture(scope="module")
def model(gemma_model) -> Model:
    return gemma_model


def alone(model, method, question, trace):
    log: list[np.ndarray] = []
    e = engine(model, method, 0.33, log)
    return e.execute(e.prepare(user_message(question), WEATHER, "required"), trace=trace), log


def in_pool(model, requests, tmp_path, slots=3, reuse="exact"):
    """``requests``: (method, question) pairs, all submitted before the loop starts."""
    lay = SlotPool.layout_for(model, make_method("pask-prior", model), 0.33, SLOT_LEN, slots=slots)
    pool = SlotPool(model, lay, start=False, reuse=reuse)
    logs = [[] for _ in requests]
    futures = []
    try:
        for k, ((method, q), log) in enumerate(zip(requests, logs, strict=True)):
            e = engine(model, method, 0.33, log)
            futures.append(pool.submit(e, e.prepare(user_message(q), WEATHER, "required"),
                                       trace=tmp_path / f"pool-{k}.jsonl"))
        pool.start()
        return [f.result(timeout=300) for f in futures], logs, pool
    finally:
        pool.close()


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv", "pask-attn"])
def test_a_whole_prompt_method_in_a_slot_compresses_as_alone(model, tmp_path, method):
    a, la = alone(model, method, ask("Paris"), tmp_path / "alone.jsonl")
    (p,), (lp,), pool = in_pool(model, [(method, ask("Paris"))], tmp_path)
    assert p.stats["slot_clamped_layers"] == 0  # the same per-layer capacities as alone
    np.testing.assert_array_equal(lp[0], la[0])  # the prefill's logits
    ca, cp = compression(tmp_path / "alone.jsonl"), compression(tmp_path / "pool-0.jsonl")
    assert ca and ca == cp
    assert p.stats["budget_used_after_prefill"] == pytest.approx(a.stats["budget_used_after_prefill"])
    assert p.ok and p.calls and p.stats["max_over_budget_entries"] <= 0, p.text
    assert p.stats["kv_bytes_allocated"] == pool.slot_bytes


def test_the_window_chunk_gets_its_own_step_beside_decoding_requests(model, tmp_path):
    """SnapKV admitted together with two pask-prior requests: its prompt's chunks share steps with
    theirs, but its last chunk, the observation window, is decoded alone, so the window statistic
    counts exactly its last queries; its compression is then the one it makes alone. It does not
    start from the first request's stream (their tool list is shared, but pask-prior evicted some
    of it while reading): a method that compresses after a whole prefill reuses only a whole prefix."""
    a, b = same_length_cities(model, 2)
    reqs = [("pask-prior", ask(a)), ("snapkv", ask(b)), ("pask-prior", ask(CITIES[-1]) + " Please.")]
    results, logs, pool = in_pool(model, reqs, tmp_path, reuse="any")  # pask-prior shares a compressed prefix
    assert [r.stats["prefix_source"] for r in results] == ["", "", "running"]
    alone(model, "snapkv", ask(b), tmp_path / "alone.jsonl")
    assert compression(tmp_path / "alone.jsonl") == compression(tmp_path / "pool-1.jsonl")
    for r in results:
        assert r.ok and r.calls[0]["name"] == "get_weather", r.text
        assert r.stats["max_over_budget_entries"] <= 0
    assert pool.stats()["tokens_per_step"] > 1.0  # the other steps did batch several sequences


def test_a_prompt_longer_than_a_slot_is_refused_for_whole_prompt_methods_only(model):
    lay = SlotPool.layout_for(model, make_method("pask-prior", model), 0.1, 2048, slots=1)
    pool = SlotPool(model, lay)
    try:
        filler = " ".join(f"Note {i}: the office plant needs water on day {i}." for i in range(45))
        q = user_message(filler + " " + ask("Paris"))
        e = engine(model, "pask-prior", 0.1)
        r = pool.execute(e, e.prepare(q, WEATHER, "required"))  # compresses while it reads: fits
        assert r.ok and r.stats["n_prompt"] > pool.whole_prompt_room
    finally:
        pool.close()


def test_every_statistic_for_many_slots_fits_the_decode_graph(model, tmp_path):
    """Eight slots, each reading attention (H2O every step, SnapKV its window): the decode graph
    computes three statistics per layer and stream; its room is reserved for them (patch 0007)."""
    qs = [("h2o" if k % 2 else "snapkv", ask(c)) for k, c in enumerate(CITIES[:8])]
    results, _, pool = in_pool(model, qs, tmp_path, slots=8)
    assert pool.layout.slots == 8
    for r in results:
        assert r.ok and r.calls[0]["name"] == "get_weather", r.text
        assert r.stats["max_over_budget_entries"] <= 0


def test_a_whole_prompt_method_shares_a_prefix_its_source_still_holds_whole(model, tmp_path):
    """Two SnapKV requests with one tool list: the second copies the first's stream while the first
    is still reading (the shared part ends before its last chunk, so nothing is compressed yet)."""
    tail = (" Also tell me whether I need an umbrella, a coat or sunglasses for a long walk by the river,"
            " and whether the wind will be strong enough in the afternoon to make cycling home unpleasant.") * 2
    qs = [("snapkv", ask("Paris") + tail), ("snapkv", ask("Rome") + tail + " Thanks.")]
    results, _, pool = in_pool(model, qs, tmp_path, slots=2)
    assert [r.stats["prefix_source"] for r in results] == ["", "running"]
    assert pool.stats()["shared_prompt_tokens"] == results[1].stats["prefix_reused"] >= 32
    for r in results:  # (the base model may ramble on these longer prompts: validity is not the point)
        assert r.stats["n_gen"] > 0 and r.stats["max_over_budget_entries"] <= 0
        assert r.stats["budget_used_after_prefill"] <= 0.33 + 0.01
    assert compression(tmp_path / "pool-1.jsonl")  # it compressed the whole prompt itself
    # the copied prefix is held whole until the question is read, as in a run of its own
    (_, q2), = qs[1:]
    (tmp_path / "own").mkdir()
    own, _, _ = in_pool(model, [("snapkv", q2)], tmp_path / "own", slots=2)
    assert results[1].stats["peak_prefill_entries"] == own[0].stats["peak_prefill_entries"]
    assert results[1].stats["held_per_group"] == own[0].stats["held_per_group"]
    assert results[1].tokens == own[0].tokens
