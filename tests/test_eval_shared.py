"""The eval harness shares one prefill among the compress-after-prefill runs of a case (real Gemma 3
270M): every (case, run) gets its record, each made from one shared prefill, resumable like the rest;
``share_prefill=False`` runs each method on its own."""

from __future__ import annotations

import json

import pytest

from pask_local.eval.runner import EvalConfig, run_eval

pytestmark = pytest.mark.slow

RUNS = dict(methods=["snapkv", "pask-prior"], budgets=[0.33, 0.2], categories=["simple_python"],
            limit=2, max_tokens=48)


def _records(out):
    return [json.loads(line) for line in (out / "cases.jsonl").read_text().splitlines() if line.strip()]


def test_compressing_runs_share_a_prefill_and_resume(tmp_path, gemma_path):
    out = tmp_path / "shared"
    store, cases, runs = run_eval(EvalConfig(gguf=gemma_path, out=out, **RUNS))
    recs = _records(out)
    assert len(recs) == len(cases) * len(runs) == 2 * 4
    for r in recs:
        shared = (r.get("stats") or {}).get("shared_prefill")
        if r["method"] == "pask-prior":  # plans its prompt: never shared
            assert shared is None
        else:
            assert shared == 2, r       # snapkv at two budgets: two runs, one prefill
        assert isinstance(r["valid"], bool) and r["n_generated"] > 0
    assert json.loads((out / "run.json").read_text())["share_prefill"] is True
    # a lost record of one shared run is regenerated alone with the others it shared (the others stay)
    lines = (out / "cases.jsonl").read_text().splitlines()
    drop = next(i for i, line in enumerate(lines) if json.loads(line)["method"] == "snapkv")
    (out / "cases.jsonl").write_text("\n".join(lines[:drop] + lines[drop + 1:]) + "\n")
    store, _, _ = run_eval(EvalConfig(gguf=gemma_path, out=out, **RUNS))
    assert len(store.records) == len(recs)


def test_share_prefill_off_runs_each_method_alone(tmp_path, gemma_path):
    out = tmp_path / "alone"
    run_eval(EvalConfig(gguf=gemma_path, out=out, share_prefill=False, **{**RUNS, "methods": ["snapkv"], "limit": 1}))
    recs = _records(out)
    assert recs and all("shared_prefill" not in (r.get("stats") or {}) for r in recs)
