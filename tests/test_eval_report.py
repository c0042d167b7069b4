"""Summary, table and plot from stored records; CLI input errors are one line and non-zero."""

from __future__ import annotations

import json

import pytest

from pask_local.errors import PaskError
from pask_local.eval.data import load_bundled
from pask_local.eval.report import markdown, summarize, write_reports
from pask_local.eval.runner import parse_budgets, runs_of
from pask_local.eval.store import ResultStore


def _rec(case, method, budget, valid):
    return {"id": case.id, "category": case.category, "method": method, "budget": budget,
            "output": "right" if valid else "wrong",
            "valid": valid, "error_type": None if valid else "x", "seconds": 1.0, "n_generated": 5,
            "n_prompt": 100, "n_reused": 40}


@pytest.fixture
def filled(tmp_path):
    a = load_bundled("simple_python")[:4]
    b = load_bundled("parallel")[:2]
    store = ResultStore(tmp_path, {"model": "m"})
    for i, c in enumerate(a):
        store.add(_rec(c, "full", None, i < 3))        # 3/4
        store.add(_rec(c, "h2o", 0.33, i < 1))         # 1/4
    for i, c in enumerate(b):
        store.add(_rec(c, "full", None, True))         # 2/2
        store.add(_rec(c, "h2o", 0.33, i < 1))         # 1/2
    return store, a + b


def test_summary_accuracy_average_retention(filled):
    store, cases = filled
    s = summarize(store, cases, [("full", None), ("h2o", 0.33)])
    full, h2o = s["runs"]
    assert full["categories"]["simple_python"]["accuracy"] == 0.75
    assert full["average"] == pytest.approx((0.75 + 1.0) / 2)
    assert h2o["average"] == pytest.approx((0.25 + 0.5) / 2)
    assert h2o["retention"] == pytest.approx(h2o["average"] / full["average"])
    assert h2o["categories"]["parallel"]["retention"] == pytest.approx(0.5)
    assert s["complete"] and full["prompt_tokens_reused"] == 240
    assert full["agreement"] == 1.0 and h2o["agreement"] == pytest.approx(3 / 6)  # same output on 3 of 6
    table = markdown(s)
    assert "| full | 75.0 | 100.0 | 87.5 | 1.000 | 100.0 |" in table
    assert "| h2o@0.33 | 25.0 | 50.0 | 37.5 | 0.429 | 50.0 |" in table


def test_reports_written_and_store_reloads(filled):
    store, cases = filled
    write_reports(store, cases, [("full", None), ("h2o", 0.33)])
    assert json.loads((store.dir / "summary.json").read_text())["n_cases"] == 6
    assert (store.dir / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    again = ResultStore(store.dir, {"model": "m"})
    assert again.records == store.records


def test_store_refuses_other_settings(filled):
    store, _ = filled
    with pytest.raises(PaskError, match="different settings"):
        ResultStore(store.dir, {"model": "other"})


def test_runs_and_budgets():
    assert runs_of(["full", "h2o", "pask"], [0.33, 0.5]) == [
        ("full", None), ("h2o", 0.33), ("h2o", 0.5), ("pask", 0.33), ("pask", 0.5)]
    assert parse_budgets("0.33, 0.2,0.33") == [0.33, 0.2]
    for bad in ("0", "1.2", "-0.1", "abc", ""):
        with pytest.raises(PaskError):
            parse_budgets(bad)
    with pytest.raises(PaskError, match="unknown method"):
        runs_of(["full", "lru"], [0.33])


@pytest.mark.parametrize("args,msg", [
    (["--methods", "lru"], "unknown method"),
    (["--categories", "simple,java"], "unknown category"),
    (["--budgets", "1.5"], "bad budget"),
    (["--split", "train"], "unknown split"),
    (["--dataset", "/nonexistent/cases.jsonl"], "dataset file not found"),
    (["--answers", "/tmp/a.jsonl"], "--answers needs --dataset"),
])
def test_cli_bad_input_is_one_line_error(args, msg, capsys, tmp_path):
    from pask_local import cli
    from pask_local.eval.cli import eval_command

    if not any(c.name == "eval" for c in cli.app.registered_commands):
        cli.app.command("eval")(eval_command)
    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--out", str(tmp_path / "o"), *args])
    assert exc.value.code != 0
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err


def test_report_only_never_generates(tmp_path):
    from pathlib import Path

    from pask_local.eval.report import summarize
    from pask_local.eval.runner import EvalConfig, run_eval

    def no_generation(method, spec):
        raise AssertionError(f"report_only built a generator for {method}")

    cfg = EvalConfig(gguf=Path("model.gguf"), out=tmp_path, methods=["full", "h2o"], categories=["simple_python"],
                     limit=2, report_only=True)
    store, cases, runs = run_eval(cfg, factory=no_generation)
    assert len(cases) == 2 and not store.records
    store.add(_rec(cases[0], "full", None, True))       # one stored case: reported, the rest stays missing
    store, cases, runs = run_eval(cfg, factory=no_generation)
    s = summarize(store, cases, runs)
    assert [r["n"] for r in s["runs"]] == [1, 0] and not s["complete"]
