"""One prefill for Full KV and the compress-after-prefill methods (engine.shared), on Gemma 3 270M.

Oracle: each method run alone (its own context, its own prefill). The shared prefill must give
every compressing method the same first-token logits bit for bit, and the same compression: the
positions each layer evicts right after the prompt (the trace's step -1 records) are the ones it
evicts alone. (Full KV shares the compressing methods' chunk cut, which alone it does not use.)
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO, compression
from test_pool import Recorder

from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.engine.shared import run_shared, shares_prefill
from pask_local.errors import PaskError
from pask_local.llm import Model
from pask_local.messages import user_message
from pask_local.schema.tools import read_tools

pytestmark = pytest.mark.slow

TOOLS = read_tools(REPO / "examples" / "get_weather.json")
QUESTION = "Weather in Paris today, in celsius?"  # 155 prompt tokens: the window needs its own cut
METHODS = [("full", 1.0), ("snapkv", 0.33), ("pyramidkv", 0.33), ("pask-attn", 0.33)]


@pytest.fixture(scope="module")
def model(gemma_model) -> Model:
    return gemma_model


def engine(model, method, budget, log):
    return Engine(model, make_method(method, model), EngineConfig(budget=budget, max_tokens=64),
                  decoder_factory=lambda m, p, s: Recorder(m, p, log))


def test_shared_prefill_gives_each_method_its_own_start(model, tmp_path):
    alone_logs, alone = [], []
    for (method, budget) in METHODS:
        log: list = []
        e = engine(model, method, budget, log)
        alone.append(e.execute(e.prepare(user_message(QUESTION), TOOLS, "required"),
                               trace=tmp_path / f"alone-{method}.jsonl"))
        alone_logs.append(log)
    logs = [[] for _ in METHODS]
    engines = [engine(model, m, b, log) for (m, b), log in zip(METHODS, logs, strict=True)]
    prepared = [e.prepare(user_message(QUESTION), TOOLS, "required") for e in engines]
    n = prepared[0].n_prompt
    assert n % 64 < EngineConfig().probe_window  # the observation window moves the last cut: shared must too
    shared = run_shared(engines, prepared, [tmp_path / f"shared-{m}.jsonl" for m, _ in METHODS])
    for (method, _budget), a, s, la, ls in zip(METHODS, alone, shared, alone_logs, logs, strict=True):
        if method != "full":  # Full alone cuts the prompt in plain chunks; shared, as the compressing methods do
            np.testing.assert_array_equal(la[0], ls[0])  # the prefill's logits
        assert s.stats["shared_prefill"] == len(METHODS)
        assert s.ok and s.calls, (method, s.text)
        assert s.stats["max_over_budget_entries"] <= 0
        if method != "full":
            ca = compression(tmp_path / f"alone-{method}.jsonl")
            cs = compression(tmp_path / f"shared-{method}.jsonl")
            assert ca and ca == cs, method
            assert s.stats["budget_used_after_prefill"] == pytest.approx(a.stats["budget_used_after_prefill"])


def test_methods_that_change_the_prompt_kv_cannot_share(model):
    assert shares_prefill(make_method("snapkv", model)) and shares_prefill(make_method("full", model))
    assert not shares_prefill(make_method("pask-prior", model)) and not shares_prefill(make_method("h2o", model))
    e1 = engine(model, "snapkv", 0.33, [])
    e2 = engine(model, "streaming", 0.33, [])
    p = [e.prepare(user_message(QUESTION), TOOLS, "required") for e in (e1, e2)]
    with pytest.raises(PaskError, match="cannot share a prefill"):
        run_shared([e1, e2], p)
    p2 = e1.prepare(user_message(QUESTION + " Thanks."), TOOLS, "required")
    with pytest.raises(PaskError, match="same prompt tokens"):
        run_shared([e1, engine(model, "full", 1.0, [])], [p[0], p2])
