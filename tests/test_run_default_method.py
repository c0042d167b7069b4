"""`pask-local run` without --method runs pask-prior (the default it shares with `serve`); with --policy and
no --method, that policy as pask.

Real runs of the embedded Gemma 3 270M through the CLI; the method a run used is read from the
engine's own ``--stats-json`` (and from the trace header), not from the CLI's arguments.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from pask_local.engine.factory import DEFAULT_METHOD, default_run_method

pytestmark = pytest.mark.slow

SCHEMA = str(REPO / "examples" / "get_weather.json")
GEMMA_POLICY = REPO / "pask_local" / "data" / "policies" / "gemma-3-270m-q4_k_m.json"


def _run(cli, tmp_path, *args: str) -> tuple[dict, dict]:
    """(stats, trace header) of one greedy run that must end in a valid call."""
    trace = tmp_path / "trace.jsonl"
    proc = cli("run", "--schema", SCHEMA, "--max-tokens", "48", "--stats-json", "--trace", str(trace), *args,
               "What is the weather in Paris in celsius?")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    call = json.loads(proc.stdout)
    assert call["name"] == "get_weather", call
    stats = json.loads([ln for ln in proc.stderr.splitlines() if ln.startswith("{")][-1])
    header = json.loads(trace.read_text().splitlines()[0])
    return stats, header


def test_rule():
    assert default_run_method(None, None) == DEFAULT_METHOD == "pask-prior"
    assert default_run_method(None, "policy.json") == "pask"
    assert default_run_method("snapkv", None) == "snapkv"
    assert default_run_method("pask-attn", "policy.json") == "pask-attn"


def test_run_without_method_is_pask_prior(cli, tmp_path):
    stats, header = _run(cli, tmp_path)
    assert stats["method"] == "pask-prior"
    assert header["method"] == "pask-prior"
    # a structural order: it evicts while it prefills and reads no attention statistics
    assert stats["graph_stats"] is False
    assert stats["budget"] == pytest.approx(0.33)


def test_policy_without_method_runs_as_pask(cli, tmp_path):
    stats, header = _run(cli, tmp_path, "--policy", str(GEMMA_POLICY))
    assert stats["method"] == "pask"
    assert header["method"] == "pask"
    assert stats["graph_stats"] is False  # the structural policy evicts while it prefills: no scores


def test_explicit_method_wins(cli, tmp_path):
    stats, _ = _run(cli, tmp_path, "--method", "streaming")
    assert stats["method"] == "streaming"
