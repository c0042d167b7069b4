"""The request run's public step protocol and its one sizing rule, on the real Gemma 3 270M.

Oracles: the sizing formulas as the engine and the pool wrote them before they shared
``kv_stream.layer_cells`` (and the cells the native cache reports it allocated); ``Engine.execute``'s
tokens for a run driven by hand through ``RunSteps`` with the calls the pool makes.
"""

from __future__ import annotations

import math

import pytest
from conftest import REPO

from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.engine.kv_stream import layer_cells, round_up
from pask_local.engine.pool import SlotPool
from pask_local.llm import Model
from pask_local.messages import user_message
from pask_local.model_info import swa_layers
from pask_local.schema.tools import read_tools

WEATHER = read_tools(REPO / "examples" / "get_weather.json")
QUESTION = "What is the weather like in Paris today? Answer in celsius."


@pytest.fixture(scope="module")
def model(gemma_model) -> Model:
    return gemma_model


def _old_engine_cells(caps, n_prompt, max_tokens, chunk, probe_window, swa, window, whole, align=256):
    """The engine's allocation as ``_Run.__init__`` computed it before ``layer_cells``."""
    max_len = n_prompt + max_tokens
    if whole:
        phys = [max_len] * len(caps)
    else:
        phys = [min(max_len, c + math.ceil(c / n_prompt * max_tokens - 1e-9) + chunk) for c in caps]
    longest = max(chunk, probe_window)
    needed = [min(p, window + longest) if il in swa else p for il, p in enumerate(phys)]
    return needed, [min(round_up(p, align), round_up(max_len, align)) for p in needed]


def _old_slot_capacities(n_layer, keeps_all, budget, slot_len, chunk, swa, window):
    """``pool.slot_capacities`` before ``layer_cells``."""
    full = round_up(slot_len)
    if keeps_all:
        return [full] * n_layer
    need = min(slot_len, math.ceil(budget * slot_len) + chunk)
    return [min(round_up(min(need, window + chunk) if (il in swa and window > 0) else need), full)
            for il in range(n_layer)]


@pytest.mark.parametrize("whole", [False, True])
def test_layer_cells_is_the_engines_old_sizing(whole):
    swa, window = (0, 2, 3), 100
    for n_prompt in (1, 37, 300, 1000):
        for max_tokens in (1, 40, 256):
            caps = [1, n_prompt // 3 + 1, n_prompt, 7, max(1, n_prompt // 10)]
            got = layer_cells(5, None if whole else caps, n_prompt, max_tokens, 64, swa, window, swa_slack=64)
            assert (got.needed, got.cells) == _old_engine_cells(caps, n_prompt, max_tokens, 64, 32, swa, window,
                                                                whole)


def test_layer_cells_is_the_pools_old_sizing():
    swa, window = (1, 4), 300
    for slot_len in (2, 100, 512, 1500):
        for budget in (0.05, 0.33, 1.0):
            for keeps_all in (False, True):
                old = _old_slot_capacities(6, keeps_all, budget, slot_len, 64, swa, window)
                if keeps_all:
                    new = layer_cells(6, None, slot_len, 0, 64).cells
                else:
                    new = layer_cells(6, [math.ceil(budget * slot_len)] * 6, slot_len, 0, 64, swa, window).cells
                assert new == old


@pytest.mark.slow
def test_pool_layout_and_engine_allocation_use_the_one_sizing(model):
    swa, window = swa_layers(model)
    assert swa, "the check wants sliding-window layers"
    method = make_method("pask-prior", model)
    lay = SlotPool.layout_for(model, method, 0.33, 512, slots=1)
    assert lay.capacities == layer_cells(model.n_layer, [math.ceil(0.33 * 512)] * model.n_layer, 512, 0,
                                         EngineConfig.chunk, swa, window).cells
    pool = SlotPool(model, lay, start=False)
    try:
        assert [pool.ctx.capacity(il) for il in range(model.n_layer)] == lay.capacities
    finally:
        pool.close()
    cfg = EngineConfig(budget=0.33, max_tokens=40)
    for name, whole in (("pask-prior", False), ("snapkv", True)):
        engine = Engine(model, make_method(name, model), cfg)
        prepared = engine.prepare(user_message(QUESTION), WEATHER, "required")
        run = engine.new_run(prepared)
        try:
            want = layer_cells(model.n_layer, None if whole else run.caps, prepared.n_prompt, cfg.max_tokens,
                               cfg.chunk, swa, window, swa_slack=max(cfg.chunk, cfg.probe_window)).cells
            assert run.stream.cells == want
            assert [run.stream.ctx.capacity(il) for il in range(model.n_layer)] == want
        finally:
            run.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pask", "h2o"])
def test_a_run_driven_by_hand_through_the_protocol_equals_execute(model, name):
    cfg = EngineConfig(budget=0.33, max_tokens=24)
    engine = Engine(model, make_method(name, model), cfg)
    prepared = engine.prepare(user_message(QUESTION), WEATHER, "required")
    ref = engine.execute(prepared)
    run = engine.new_run(prepared)
    try:
        run.begin(prepared.plan, prepared.request)
        ctx, probe, seq = run.stream.ctx, run.stream.probe, run.stream.seq_id
        chunks = run.prefill_bounds()   # as the pool admits a request
        for a, b in chunks:              # as the pool's run_step feeds a prompt chunk
            if probe is not None:
                probe.reset()
            assert ctx.decode_batch(run.prompt.tokens[a:b], list(range(a, b)), [seq] * (b - a),
                                    [p == b - 1 for p in range(a, b)]) == 0
            run.after_chunk(a, b)
        run.end_prefill()
        tok = run.next_token(ctx.logits(b - a - 1))
        while tok is not None:           # one token per step
            if probe is not None and run.scores_each_decode:
                probe.reset()
            assert ctx.decode_batch([tok], [run.pos], [seq], [True]) == 0
            run.after_token()
            tok = run.next_token(ctx.logits(0))
        res = run.result()
    finally:
        run.close()
    assert res.tokens == ref.tokens and res.text == ref.text
    assert res.stats["held_per_group"] == ref.stats["held_per_group"]
