"""One context size for every method: Full KV's context from the longest case; a case no method can
run (too long for the model's context) is skipped for all of them and listed in the report."""

from __future__ import annotations

import io
import json

import pytest
from eval_helpers import FN
from rich.console import Console

from pask_local.eval.report import write_reports
from pask_local.eval.runner import EvalConfig, run_eval
from pask_local.eval.sizing import Skipped, load_skipped, save_skipped, size_context


def test_size_context_from_the_longest_case():
    # the case: 8009 + 200 failed Full KV at a fixed 8192 while compressed runs passed
    assert size_context({"a": 500, "b": 8009}, 200, 32768) == (8448, [])
    n_ctx, skipped = size_context({"a": 500, "b": 8009}, 200, 8192)
    assert n_ctx == 768 and skipped == [Skipped("b", 8009, 200, 8192)]
    assert size_context({"a": 8000}, 150, 8150) == (8150, [])  # never past the model's context
    assert size_context({}, 64, 4096) == (256, [])
    assert "skipped b: prompt 8009 + max_tokens 200" in skipped[0].line()


def test_skipped_list_survives_a_resume(tmp_path):
    save_skipped(tmp_path, [Skipped("x", 9000, 10, 8192)])
    save_skipped(tmp_path, [Skipped("y", 9100, 10, 8192)])
    assert [s.id for s in load_skipped(tmp_path)] == ["x", "y"]


@pytest.mark.slow
def test_a_case_too_long_for_the_context_is_skipped_for_every_method(tmp_path, gemma_path):
    long_fn = {**FN, "name": "get_forecast", "description": "Forecast. " + "Very detailed notes. " * 200}
    path = tmp_path / "mine.jsonl"
    entries = [
        {"id": "short_0", "question": [[{"role": "user", "content": "Weather in Paris?"}]], "function": [FN],
         "ground_truth": [{"get_weather": {"city": ["Paris"]}}]},
        {"id": "long_0", "question": [[{"role": "user", "content": "Forecast for Paris?"}]], "function": [long_fn],
         "ground_truth": [{"get_forecast": {"city": ["Paris"]}}]},
    ]
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    out = tmp_path / "res"
    # n_ctx caps the context as the model's trained context would (Gemma's 32k is too costly to fill here)
    cfg = EvalConfig(gguf=gemma_path, out=out, methods=["full", "streaming"], budgets=[0.5], dataset=path,
                     split="all", max_tokens=16, n_ctx=512, use_examples=False)
    log = io.StringIO()
    store, cases, runs = run_eval(cfg, Console(file=log, width=300))
    assert [c.id for c in cases] == ["short_0"]
    assert {k[0] for k in store.records} == {"short_0"} and len(store.records) == 2
    assert "skipped long_0: prompt" in log.getvalue() and "Full KV context: 256 tokens" in log.getvalue()
    summary = write_reports(store, cases, runs)
    assert summary["complete"] and len(summary["skipped"]) == 1
    table = (out / "results.md").read_text()
    assert "- skipped long_0: prompt" in table and "exceed the model's context (512 tokens)" in table
    # resumed and re-reported: nothing generated again, the skipped case still listed, never missing
    store2, cases2, _ = run_eval(EvalConfig(**{**cfg.__dict__, "report_only": True}), Console(file=io.StringIO()))
    assert [c.id for c in cases2] == ["short_0"] and store2.records == store.records
