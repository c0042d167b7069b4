"""The engine's invariants on whichever backend runs the model: the CPU here, a CUDA GPU when
``scripts/gpu_check`` runs this file with ``PASK_NGL=99`` on a CUDA build (every layer, the K/V cache,
the attention statistics and the native step's cells then live on the device).

Synthetic GGUFs written by the project (random weights: behaviour, never accuracy): qwen3 (global
attention, GQA) and gemma3 (sliding-window layers), F16 matrices, flash attention off and on.
- budget 1.0 is Full KV: every method generates exactly the upstream cache's tokens (one process);
- the budget holds for every method, read from the native cache at every step;
- the native step evicts exactly what the Python reference rules evict (hysteresis 0, no compaction);
- a q8_0 K/V cache (flash attention on) holds the budget for a structural and a score method.
"""

from __future__ import annotations

import pytest
from conftest import evictions
from kv_layered_helpers import synthetic

from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.llm import Model, default_gpu_layers
from pask_local.methods import METHOD_NAMES

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}},
        "required": ["city"]}}}]
REQUEST = "What is the weather like in Paris today? Answer in celsius, please."
BUDGETED = [m for m in METHOD_NAMES if m != "full"]


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def model(request, tmp_path_factory) -> Model:
    dims = {"n_ctx": 4096, "head_dim": 32} | ({"sliding_window": 64} if request.param == "gemma3" else {})
    path = synthetic(tmp_path_factory.mktemp("backend"), request.param, dtype="f16", n_layer=4, seed=5, **dims)
    m = Model(path)  # PASK_NGL: every layer on the GPU in scripts/gpu_check
    yield m
    m.close()


def run(model: Model, method: str, budget: float, trace=None, **cfg):
    engine = Engine(model, make_method(method, model), EngineConfig(budget=budget, max_tokens=40, **cfg))
    return engine.run(TOOLS, REQUEST, trace=trace)


def test_the_backend_is_the_one_asked_for(model):
    """What this file checks runs where PASK_NGL says (0 here: the CPU)."""
    assert default_gpu_layers() >= 0
    res = run(model, "pask", 0.33)
    assert res.stats["n_prompt"] > 300, "the prompt must be long enough for the budget to evict"


@pytest.mark.parametrize("fa", [False, True], ids=["plain", "flash-attn"])
def test_budget_one_is_full_kv_for_every_method(model, fa):
    full = run(model, "full", 1.0, flash_attn=fa)
    assert full.tokens, "Full KV generated nothing: the comparison would be empty"
    for method in BUDGETED:
        res = run(model, method, 1.0, flash_attn=fa)
        assert res.tokens == full.tokens, method


@pytest.mark.parametrize("budget", [0.33, 0.2])
@pytest.mark.parametrize("fa", [False, True], ids=["plain", "flash-attn"])
def test_every_method_holds_the_budget(model, fa, budget):
    for method in BUDGETED:
        res = run(model, method, budget, flash_attn=fa)
        s = res.stats
        assert s["max_over_budget_entries"] <= 0, method
        # the final share: the budget, plus what the prefill chunk in flight and rounding allow
        assert s["budget_used_final"] <= budget + 0.02, (method, s["budget_used_final"])
        assert s["flash_attn"] == fa


@pytest.mark.parametrize("method", ["pask", "pask-hybrid", "h2o", "tova", "snapkv", "streaming"])
def test_native_step_evicts_as_the_python_reference(model, method, tmp_path):
    ref_trace, nat_trace = tmp_path / "ref.jsonl", tmp_path / "nat.jsonl"
    ref = run(model, method, 0.2, ref_trace, native_step=False)
    nat = run(model, method, 0.2, nat_trace, hysteresis=0.0, compact=False)
    ev_ref = evictions(ref_trace)
    assert any(step >= 0 for step, _, _ in ev_ref), "no decode-time eviction: the check is empty"
    assert evictions(nat_trace) == ev_ref
    assert nat.tokens == ref.tokens


@pytest.mark.parametrize("method", ["pask", "snapkv"])
def test_a_q8_0_cache_holds_the_budget(model, method):
    res = run(model, method, 0.33, kv_type="q8_0")
    assert res.stats["kv_type"] == "q8_0" and res.stats["flash_attn"]
    assert res.stats["max_over_budget_entries"] <= 0
    assert res.tokens
