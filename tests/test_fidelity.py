"""The fidelity metric (``eval --fidelity``): teacher forcing along Full KV's output on the engine path.

Real llama.cpp and the embedded Gemma 3 270M: at budget 1.0 every method's KL to Full KV is ~0 and
its top-1 agreement 100%; at a small budget the KL is positive while the forced run still emits
exactly Full KV's tokens; the per-class counts add up to the steps; the gold call's NLL is measured;
the CLI on a 2-case dataset writes the columns, the references and the plot. The KL arithmetic
(top-K + pooled rest) is checked against the full-vocabulary KL on random distributions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO
from eval_helpers import FN

from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.eval.data import load_file
from pask_local.eval.fidelity import (
    GROUP_NAMES,
    compute_reference,
    forced_run,
    method_fidelity,
    pool,
    reference_fidelity,
)
from pask_local.eval.forced import coarse_kl, log_softmax, top_k_step
from pask_local.eval.prompting import make_task, task_plan
from pask_local.eval.report import markdown, summarize
from pask_local.eval.runner import _done
from pask_local.eval.store import ResultStore
from pask_local.llm import Model

pytestmark = pytest.mark.slow

CITIES = ("Paris", "Oslo")


def write_dataset(path, filler: int = 0) -> None:
    tail = " Thanks." * filler
    rows = [{"id": f"fid_{i}", "question": [[{"role": "user", "content": f"Weather in {city} in celsius?{tail}"}]],
             "function": [FN], "ground_truth": [{"get_weather": {"city": [city], "unit": ["", "c"]}}]}
            for i, city in enumerate(CITIES)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


# ------------------------------------------------------------------ the KL arithmetic (no model)
def _kl(p_lp: np.ndarray, q_lp: np.ndarray) -> float:
    return float(np.sum(np.exp(p_lp) * (p_lp - q_lp)))


def test_coarse_kl_is_a_tight_lower_bound():
    rng = np.random.default_rng(0)
    for _ in range(20):
        p = log_softmax(rng.normal(0, 4, 5000))
        q = log_softmax(rng.normal(0, 4, 5000))
        exact = _kl(p, q)
        coarse = coarse_kl(top_k_step(p, 128), q)
        assert 0.0 <= coarse <= exact + 1e-9
        assert coarse_kl(top_k_step(p, 5000), q) == pytest.approx(exact, rel=1e-9, abs=1e-12)
        assert coarse_kl(top_k_step(p, 128), p) < 1e-12
        ref = top_k_step(p, 128)
        assert list(ref.ids[:3]) == list(np.argsort(-p, kind="stable")[:3])
        np.testing.assert_allclose(np.exp(ref.lp).sum() + np.exp(ref.rest), 1.0, rtol=1e-12)


def test_pool_is_token_weighted():
    a = {"n": 2, "kl": 1.0, "top1": 1.0, "groups": {"key": {"n": 2, "kl": 1.0, "top1": 1.0}},
         "gold_n": 1, "gold_nll": 2.0, "gold_nll_full": 1.0}
    b = {"n": 6, "kl": 0.0, "top1": 0.5, "groups": {"key": {"n": 6, "kl": 0.0, "top1": 0.5}},
         "gold_n": 3, "gold_nll": 1.0, "gold_nll_full": 1.0}
    p = pool([{"fidelity": a}, {"fidelity": b}, {"output": "no fidelity"}])
    assert p["n"] == 8 and p["kl"] == pytest.approx(0.25) and p["top1"] == pytest.approx(5 / 8)
    assert p["groups"]["key"]["n"] == 8 and p["gold_nll"] == pytest.approx(1.25)
    assert p["gold_dnll"] == pytest.approx(0.25) and p["cases"] == 2
    assert pool([{"output": "x"}]) is None


def test_report_columns_and_resume_rule(tmp_path):
    fid = {"n": 4, "kl": 0.5, "top1": 0.75, "gold_n": 2, "gold_nll": 1.5, "gold_nll_full": 1.0,
           "groups": {"name": {"n": 1, "kl": 2.0, "top1": 0.0}, "punct": {"n": 3, "kl": 0.0, "top1": 1.0}}}
    store = ResultStore(tmp_path, {"model": "m"})
    write_dataset(tmp_path / "ds.jsonl")
    cases = load_file(tmp_path / "ds.jsonl")
    store.add({"id": cases[0].id, "category": "custom", "method": "h2o", "budget": 0.5, "output": "x",
               "valid": True, "fidelity": fid})
    store.add({"id": cases[1].id, "category": "custom", "method": "h2o", "budget": 0.5, "output": "x",
               "valid": False})
    assert _done(store, cases[0], ("h2o", 0.5), True) and _done(store, cases[1], ("h2o", 0.5), False)
    assert not _done(store, cases[1], ("h2o", 0.5), True)   # --fidelity redoes a record without it
    table = markdown(summarize(store, cases, [("h2o", 0.5)]))
    row = next(line for line in table.splitlines() if line.startswith("| h2o@0.5 | 50.0 | 50.0 | 0.5 | 75.0 |"))
    assert "1.500 | +0.500" in row
    assert "| KL name | KL punct | top-1 name % | top-1 punct % |" in table   # classes not seen: no column
    assert "KL key" not in table


# ------------------------------------------------------------------ real model
@pytest.fixture(scope="module")
def model(gemma_model) -> Model:
    return gemma_model


def _n_prompt(model, case) -> int:
    return len(task_plan(model, make_task(case, use_examples=False), "plain", 128, 8).prompt.tokens)


@pytest.fixture(scope="module")
def case(model, tmp_path_factory):
    """A case whose last 64-token prefill chunk holds at least 32 tokens.

    Gemma's logits depend on how the prompt is cut into ubatches (up to ~1 logit on this CPU build,
    upstream llama.cpp alone: docs/fidelity.md, noise floor). SnapKV, PyramidKV and pask-attn move the
    last chunk boundary when the last chunk is shorter than their 32-token observation window, so the
    budget-1.0 test picks a prompt (by padding the request) where every method cuts it like Full KV."""
    path = tmp_path_factory.mktemp("fid") / "ds.jsonl"
    for filler in range(40):
        write_dataset(path, filler)
        c = load_file(path)[0]
        if _n_prompt(model, c) % 64 >= 32:
            return c
    raise AssertionError("no filler gives a last prefill chunk of >= 32 tokens")


@pytest.fixture(scope="module")
def task(case):
    return make_task(case, use_examples=False)


@pytest.fixture(scope="module")
def aligned_cfg(model, case) -> EngineConfig:
    """max_tokens such that prompt + max_tokens = 512 cells per layer (a multiple of 256): the layered
    cache then runs the attention kernels upstream's padded cache runs (docs/fidelity.md, noise floor)."""
    n_prompt = _n_prompt(model, case)
    assert n_prompt < 400
    return EngineConfig(budget=1.0, max_tokens=512 - n_prompt, style="instruction")


@pytest.fixture(scope="module")
def reference(model, case, task, aligned_cfg):
    full = Engine(model, make_method("full", model), aligned_cfg)
    return compute_reference(full, case, task)


def _engine(model, method: str, cfg: EngineConfig, budget: float) -> Engine:
    return Engine(model, make_method(method, model), EngineConfig(**{**cfg.__dict__, "budget": budget}))


def test_reference_is_fulls_own_greedy_output(model, task, aligned_cfg, reference):
    res = Engine(model, make_method("full", model), aligned_cfg).run(task.functions, task.request)
    assert reference.tokens[:len(res.tokens)] == res.tokens
    assert len(reference.tokens) - len(res.tokens) in (0, 1)  # + the end token when it stopped on one
    assert len(reference.steps) == len(reference.tokens) == len(reference.classes)
    assert reference.gold and reference.gold_error is None and len(reference.gold_lp) == len(reference.gold)
    own = reference_fidelity(reference)
    assert own["kl"] == 0.0 and own["top1"] == 1.0
    assert own["gold_nll"] == pytest.approx(-np.mean(reference.gold_lp))


@pytest.mark.parametrize("method", ["streaming", "snapkv", "pask", "pask-attn", "h2o"])
def test_budget_one_has_zero_kl_and_full_agreement(model, task, aligned_cfg, reference, method):
    res, dec = forced_run(_engine(model, method, aligned_cfg, 1.0), task, forced=reference.tokens,
                          ref=reference.steps)
    assert [s.token for s in dec.steps] == reference.tokens
    assert max(s.kl for s in dec.steps) < 1e-6
    assert all(s.own == t for s, t in zip(dec.steps, reference.tokens, strict=True))


@pytest.mark.parametrize("method", ["streaming", "pask"])
def test_small_budget_diverges_but_follows_fulls_tokens(model, case, task, aligned_cfg, reference, method):
    engine = _engine(model, method, aligned_cfg, 0.1)
    res, dec = forced_run(engine, task, forced=reference.tokens, ref=reference.steps)
    assert [s.token for s in dec.steps] == reference.tokens           # forced: exactly Full KV's tokens
    assert list(res.tokens) == [t for t in reference.tokens if not model.is_eog(t)]
    assert max(s.kl for s in dec.steps) > 1e-3
    fid = method_fidelity(engine, case, task, reference)
    assert fid["same_tokens"] and fid["n"] == len(reference.tokens)
    assert sum(g["n"] for g in fid["groups"].values()) == fid["n"]
    assert set(fid["groups"]) <= set(GROUP_NAMES) and {"name", "key", "punct"} <= set(fid["groups"])
    assert 0.0 <= fid["top1"] <= 1.0 and fid["kl"] > 0
    assert fid["gold_n"] == len(reference.gold) and fid["gold_nll"] > 0
    assert fid["gold_nll_full"] == pytest.approx(-np.mean(reference.gold_lp))


# ------------------------------------------------------------------ the CLI
def test_eval_cli_writes_fidelity(tmp_path):
    ds = tmp_path / "ds.jsonl"
    write_dataset(ds)
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", "from pask_local.cli import main; main()", "eval", "--dataset", str(ds),
           "--split", "all", "--methods", "full,streaming", "--budgets", "0.2", "--max-tokens", "40",
           "--no-examples", "--fidelity", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PASK_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    table = (out / "results.md").read_text()
    header = table.splitlines()[0]
    for col in ("average", "KL", "top-1 %", "gold NLL", "gold dNLL"):
        assert f"| {col} |" in header
    assert "| KL name |" in table and "| top-1 punct % |" in table
    recs = [json.loads(line) for line in (out / "cases.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(rec["fidelity"]["n"] > 0 for rec in recs)
    runs = {row["label"]: row for row in json.loads((out / "summary.json").read_text())["runs"]}
    assert runs["full"]["fidelity"]["kl"] == 0.0 and runs["streaming@0.2"]["fidelity"]["kl"] > 0
    assert 0.0 <= runs["full"]["fidelity"]["same_output"] <= 1.0
    assert 0.0 <= runs["full"]["fidelity"]["same_output"] <= 1.0
    assert runs["streaming@0.2"]["fidelity"]["gold_cases"] == 2
    assert (out / "fidelity.png").stat().st_size > 0
    assert len(list((out / "fidelity_ref").glob("*.npz"))) == 2
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)  # resumed: nothing to do
    assert again.returncode == 0
    assert len((out / "cases.jsonl").read_text().splitlines()) == 4


# ------------------------------------------------------------------ references shared between runs
def _eval_cmd(ds, out, refs, *extra: str) -> list[str]:
    return [sys.executable, "-c", "from pask_local.cli import main; main()", "eval", "--dataset", str(ds),
            "--methods", "streaming", "--budgets", "0.2", "--max-tokens", "24", "--no-examples", "--fidelity",
            "--fidelity-refs", str(refs), "--out", str(out), *extra]


def test_concurrent_runs_share_one_reference_per_case(tmp_path):
    """Two processes started together on the same cases compute each reference once (the lock)."""
    ds, refs = tmp_path / "ds.jsonl", tmp_path / "refs"
    write_dataset(ds)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PASK_THREADS": "1"}
    procs = [subprocess.Popen(_eval_cmd(ds, tmp_path / f"out{i}", refs), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    logs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in logs]
    counts = []
    for _, err in logs:
        line = next(ln for ln in err.splitlines() if ln.startswith("Full KV references:"))
        computed, reused = (int(w) for w in line.split(":")[1].replace(",", " ").split() if w.isdigit())
        counts.append((computed, reused))
    assert sum(c for c, _ in counts) == len(CITIES) and sum(r for _, r in counts) == len(CITIES)
    assert len(list(refs.glob("*.npz"))) == len(CITIES)
    a, b = ([json.loads(ln) for ln in (tmp_path / f"out{i}" / "cases.jsonl").read_text().splitlines()]
            for i in range(2))
    assert [r["fidelity"]["kl"] for r in a] == [r["fidelity"]["kl"] for r in b]  # the same references


def test_shared_references_refuse_other_settings(tmp_path):
    ds, refs = tmp_path / "ds.jsonl", tmp_path / "refs"
    write_dataset(ds)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PASK_THREADS": "1"}
    (refs).mkdir()
    (refs / "settings.json").write_text(json.dumps({"max_tokens": 99}))
    r = subprocess.run(_eval_cmd(ds, tmp_path / "out", refs), capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "made with other settings" in r.stderr and "max_tokens" in r.stderr
    assert not (tmp_path / "out" / "cases.jsonl").exists() or not (tmp_path / "out" / "cases.jsonl").read_text()
    (refs / "settings.json").write_text("[1, 2]")  # JSON, but not settings
    r = subprocess.run(_eval_cmd(ds, tmp_path / "out", refs), capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "settings.json is unreadable" in r.stderr
    no_fid = [a for a in _eval_cmd(ds, tmp_path / "out2", refs) if a != "--fidelity"]
    r = subprocess.run(no_fid, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode != 0 and "--fidelity-refs needs --fidelity" in r.stderr and "Traceback" not in r.stderr
