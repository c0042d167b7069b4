"""A quantized KV cache (q8_0, q4_0) under the layered cache, on the real Gemma 3 270M.

Oracle: upstream llama.cpp's own cache of the same type. At a capacity that holds everything the
layered cache gives upstream's logits bit for bit; its bytes are upstream's per cell; a budgeted
method holds its budget, and so does a method that reads attention scores (a quantized V cache
needs flash attention; the statistics are computed in the decode graph beside it, patch 0007).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO
from test_pool import Recorder

from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.errors import PaskError
from pask_local.llm import Model
from pask_local.messages import user_message
from pask_local.schema.tools import read_tools

pytestmark = pytest.mark.slow

WEATHER = read_tools(REPO / "examples" / "get_weather.json")
QUESTION = "What is the weather like in Paris today? Answer in celsius."


@pytest.fixture(scope="module")
def model(gemma_model) -> Model:
    return gemma_model


def run(model, method, budget, kv_type, log=None):
    factory = (lambda m, p, s: Recorder(m, p, log)) if log is not None else None
    kw = {"decoder_factory": factory} if factory else {}
    e = Engine(model, make_method(method, model), EngineConfig(budget=budget, max_tokens=48, kv_type=kv_type), **kw)
    return e.execute(e.prepare(user_message(QUESTION), WEATHER, "required"))


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_layered_quantized_cache_at_full_capacity_equals_upstream(model, kv_type):
    up_log, lay_log = [], []
    up = run(model, "full", 1.0, kv_type, up_log)
    lay = run(model, "pask-prior", 1.0, kv_type, lay_log)
    assert up.stats["kv_type"] == lay.stats["kv_type"] == kv_type and lay.stats["flash_attn"]
    assert up.tokens == lay.tokens and len(up_log) == len(lay_log) > 0
    for x, y in zip(up_log, lay_log, strict=True):
        np.testing.assert_array_equal(x, y)


def test_quantized_bytes_and_budget(model):
    f16 = run(model, "full", 1.0, "f16").stats
    q8 = run(model, "full", 1.0, "q8_0").stats
    # q8_0: 34 bytes per 32 values, f16: 64
    assert q8["kv_bytes_allocated"] * 64 == f16["kv_bytes_allocated"] * 34
    pq = run(model, "pask-prior", 0.33, "q8_0")
    assert pq.ok and pq.stats["max_over_budget_entries"] <= 0
    pf = run(model, "pask-prior", 0.33, "f16").stats
    assert pq.stats["kv_bytes_allocated"] * 64 == pf["kv_bytes_allocated"] * 34


@pytest.mark.parametrize("method", ["snapkv", "h2o", "tova"])
def test_score_methods_hold_the_budget_on_a_quantized_cache(model, method):
    r = run(model, method, 0.33, "q8_0")
    assert r.stats["flash_attn"] and r.stats["kv_type"] == "q8_0" and len(r.tokens) > 0
    assert r.stats["max_over_budget_entries"] <= 0


def test_a_score_method_at_full_capacity_on_q8_0_equals_upstream(model):
    """The statistic nodes the graph gains for SnapKV change nothing the model computes."""
    up_log, lay_log = [], []
    up = run(model, "full", 1.0, "q8_0", up_log)
    snap = run(model, "snapkv", 1.0, "q8_0", lay_log)
    assert snap.stats["flash_attn"] and up.ok and up.tokens == snap.tokens
    for x, y in zip(up_log, lay_log, strict=True):
        np.testing.assert_array_equal(x, y)


def test_an_unknown_kv_type_is_refused(model):
    with pytest.raises(PaskError, match="unknown KV cache type"):
        Engine(model, make_method("pask-prior", model), EngineConfig(kv_type="q9"))
