"""Smoke eval on the real embedded Gemma 3 270M: outputs written, scored, resumable; prefix cache exact.

Needs the patched libllama with the grammar patch (0003) for constrained decoding, and the layered
KV patch for the baseline run; like the other native tests these fail loudly when the build lacks them.
"""

from __future__ import annotations

import json

import pytest

from pask_local.eval.data import CATEGORIES, load_bundled
from pask_local.eval.generator import GeneratorSpec, make_generator
from pask_local.eval.report import write_reports
from pask_local.eval.runner import EvalConfig, run_eval
from pask_local.eval.split import split_of

pytestmark = pytest.mark.slow


class Counting:
    """Wraps make_generator and counts generate() calls (the real generator runs)."""

    def __init__(self) -> None:
        self.built = 0
        self.calls = 0

    def __call__(self, method, spec):
        self.built += 1
        gen = make_generator(method, spec)
        outer = self

        class Wrapped:
            def __init__(self):
                self.method, self.budget = gen.method, gen.budget

            def generate(self, case):
                outer.calls += 1
                return gen.generate(case)

            def describe(self):
                return gen.describe()

            def close(self):
                gen.close()

        return Wrapped()


def _records(out):
    return [json.loads(line) for line in (out / "cases.jsonl").read_text().splitlines() if line.strip()]


def test_smoke_eval_full_all_categories_resumable(tmp_path, gemma_path):
    out = tmp_path / "res"
    cfg = EvalConfig(gguf=gemma_path, out=out, methods=["full"], limit=1, max_tokens=32)
    counter = Counting()
    store, cases, runs = run_eval(cfg, factory=counter)
    summary = write_reports(store, cases, runs)

    assert len(cases) == len(CATEGORIES) and counter.calls == len(cases)
    assert all(split_of(c.id) == "eval" for c in cases)
    recs = _records(out)
    assert sorted(r["id"] for r in recs) == sorted(c.id for c in cases)
    for r in recs:
        assert r["method"] == "full" and r["budget"] is None
        assert isinstance(r["valid"], bool) and (r["error_type"] is None) == r["valid"]
        assert r["n_prompt"] > 0 and r["seconds"] > 0
        assert r["n_generated"] > 0 or r["error_type"] == "generation_error"
    assert any(r["valid"] for r in recs)          # the scorer accepts real correct outputs
    assert any(r["n_reused"] > 0 for r in recs)   # the shared prefix was not decoded again
    for name in ("summary.json", "results.md", "accuracy.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["runs"][0]["n"] == len(cases)
    assert "| full |" in (out / "results.md").read_text()

    # a rerun recomputes nothing (no generator is even built)
    again = Counting()
    run_eval(cfg, factory=again)
    assert again.built == 0 and again.calls == 0
    assert _records(out) == recs

    # an interrupted run (last 3 records lost, one half-written line) redoes exactly those cases
    lines = (out / "cases.jsonl").read_text().splitlines()
    (out / "cases.jsonl").write_text("\n".join(lines[:-3]) + "\n" + lines[-3][:25])
    resumed = Counting()
    store, _, _ = run_eval(cfg, factory=resumed)
    assert resumed.calls == 3
    assert len(store.records) == len(cases)


def test_prefix_cache_matches_fresh_prefill(gemma_path):
    cases = [c for c in load_bundled("simple_python")[:12] if split_of(c.id) == "eval"][:2]
    cases += [c for c in load_bundled("parallel")[:8] if split_of(c.id) == "eval"][:1]
    cached = make_generator("full", GeneratorSpec(gemma_path, max_tokens=32, n_ctx=2048))
    fresh = make_generator("full", GeneratorSpec(gemma_path, max_tokens=32, n_ctx=2048, reuse_prefix=False))
    try:
        reused = 0
        for case in cases:
            a, b = cached.generate(case), fresh.generate(case)
            assert b.n_reused == 0
            reused += a.n_reused
            assert a.text == b.text, case.id
        assert reused > 0
    finally:
        cached.close()
        fresh.close()


def test_smoke_eval_one_baseline(tmp_path, gemma_path):
    out = tmp_path / "base"
    cfg = EvalConfig(gguf=gemma_path, out=out, methods=["full", "streaming"], budgets=[0.5],
                     categories=["simple_python", "parallel"], limit=1, max_tokens=32)
    store, cases, runs = run_eval(cfg)
    summary = write_reports(store, cases, runs)
    assert runs == [("full", None), ("streaming", 0.5)]
    recs = _records(out)
    assert len(recs) == 2 * len(cases)
    streaming = [r for r in recs if r["method"] == "streaming"]
    assert all(r["budget"] == 0.5 and r["error_type"] != "generation_error" for r in streaming), streaming
    row = next(r for r in summary["runs"] if r["method"] == "streaming")
    assert row["n"] == len(cases)


def test_policy_file_runs_pask_with_that_policy_and_is_pinned(tmp_path, gemma_path, cli):
    from pask_local.policy.handwritten import handwritten_policy

    # the hand-written prior as a file: pask with it must do exactly what pask-prior does, while pask
    # without it runs the embedded model's calibrated policy (another compression)
    prior = tmp_path / "prior.json"
    handwritten_policy(18).save(prior)
    args = ["eval", "--categories", "simple_python", "--limit", "2", "--max-tokens", "24",
            "--methods", "pask,pask-prior", "--budgets", "0.3"]
    with_file, default = tmp_path / "with", tmp_path / "default"
    assert cli(*args, "--policy", str(prior), "--out", str(with_file)).returncode == 0
    assert cli(*args, "--out", str(default)).returncode == 0

    def held(out, method):
        return [(r["id"], r["output"], r["stats"]["held_per_group"]) for r in _records(out) if r["method"] == method]

    assert held(with_file, "pask") == held(with_file, "pask-prior")
    assert held(default, "pask") != held(default, "pask-prior")
    run = json.loads((with_file / "run.json").read_text())
    assert run["policy"]["file"] == "prior.json" and len(run["policy"]["sha256"]) == 64
    # the directory belongs to its policy: reusing it without (or with another) is refused in one line
    r = cli(*args, "--out", str(with_file))
    assert r.returncode != 0 and "different settings (policy)" in r.stderr
    bad = cli(*args, "--policy", str(tmp_path / "nope.json"), "--out", str(tmp_path / "x"))
    assert bad.returncode != 0 and "policy file not found" in bad.stderr
    only = cli("eval", "--methods", "snapkv", "--policy", str(prior), "--out", str(tmp_path / "y"))
    assert only.returncode != 0 and "none of them is in --methods" in only.stderr
