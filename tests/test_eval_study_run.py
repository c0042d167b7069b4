"""``pask-local study run`` on the embedded Gemma: job plan, parallel one-thread jobs, merged table, resume."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli

from pask_local.study import run as study_script

pytestmark = pytest.mark.slow


def test_plan_shares_one_prefill_between_the_compress_after_prefill_methods(gemma_path):
    jobs = study_script.plan_jobs(gemma_path, ["full", "streaming", "snapkv", "pask-prior", "pyramidkv"],
                                  ["0.33", "0.2"])
    assert [(j.name, j.methods, j.budgets) for j in jobs] == [
        ("shared", ("snapkv", "pyramidkv"), ("0.33", "0.2")),
        ("full", ("full",), ("1",)),
        ("streaming-0.33", ("streaming",), ("0.33",)), ("streaming-0.2", ("streaming",), ("0.2",)),
        ("pask-prior-0.33", ("pask-prior",), ("0.33",)), ("pask-prior-0.2", ("pask-prior",), ("0.2",)),
    ]

    # a --fidelity study: teacher-forced runs share no prefill, so every run is a job of its own
    jobs = study_script.plan_jobs(gemma_path, ["full", "snapkv", "pyramidkv"], ["0.2"], share=False)
    assert [j.name for j in jobs] == ["full", "snapkv-0.2", "pyramidkv-0.2"]


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_cli("study", "run", "--categories", "simple_python,multiple", "--limit", "1",
                   "--methods", "full,streaming,snapkv,pask-prior", "--budgets", "0.33", "--jobs", "2",
                   "--out", str(out), *extra, "--", "--max-tokens", "16", timeout=900)


def test_study_runs_in_parallel_jobs_and_resumes(tmp_path):
    out = tmp_path / "study"
    r = _run(out)
    assert r.returncode == 0, r.stderr
    st = json.loads((out / "study.json").read_text())
    assert st["n_cases"] == 2 and st["cases_left_out"] == 0
    assert [row["label"] for row in st["runs"]] == ["full", "streaming@0.33", "snapkv@0.33", "pask-prior@0.33"]
    assert {j["name"] for j in st["jobs"]} == {"full", "streaming-0.33", "snapkv-0.33", "pask-prior-0.33"}
    for j in st["jobs"]:  # each job wrote its own resumable directory, one record per case
        assert len((out / j["name"] / "cases.jsonl").read_text().splitlines()) == 2
    (b,) = st["budgets"]
    assert b["best_baseline"] in ("streaming", "snapkv") and b["pask_vs_best"][0]["n"] == 2
    assert (out / "study.png").read_bytes()[:4] == b"\x89PNG"
    before = {j["name"]: (out / j["name"] / "cases.jsonl").read_text() for j in st["jobs"]}
    again = _run(out)  # a rerun generates nothing and rebuilds the same table
    assert again.returncode == 0, again.stderr
    assert {n: (out / n / "cases.jsonl").read_text() for n in before} == before
    assert again.stdout == r.stdout


def test_bad_input_is_one_line(tmp_path):
    r = run_cli("study", "run", "--methods", "full,nope", "--out", str(tmp_path / "x"), timeout=300)
    assert r.returncode == 1
    assert r.stderr.strip().startswith("error: unknown method(s) nope") and len(r.stderr.strip().splitlines()) == 1
