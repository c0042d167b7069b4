"""Loading BFCL-format cases: bundled categories, user files (JSONL/array, inline or separate answers)."""

from __future__ import annotations

import json

import pytest
from eval_helpers import FN

from pask_local.eval.checker import score_output
from pask_local.eval.data import (
    CATEGORIES,
    DataError,
    canonical_category,
    load_bundled,
    load_cases,
    load_file,
)
from pask_local.eval.split import split_of


def _entry(i: int) -> dict:
    return {"id": f"mine_{i}", "question": [[{"role": "user", "content": f"Weather in Paris {i}?"}]],
            "function": [FN]}


def test_bundled_categories_load_with_answers():
    sizes = {}
    for cat in CATEGORIES:
        cases = load_bundled(cat)
        sizes[cat] = len(cases)
        assert all(c.answer for c in cases) and all(c.category == cat for c in cases)
        assert all(c.request for c in cases)
    assert sizes["simple_python"] == 400 and sizes["live_parallel"] == 16


def test_alias_and_unknown_category():
    assert canonical_category("simple") == "simple_python"
    with pytest.raises(DataError, match="unknown category"):
        canonical_category("java_simple")


def test_user_file_with_separate_answers(tmp_path):
    q = tmp_path / "q.jsonl"
    a = tmp_path / "a.jsonl"
    q.write_text("\n".join(json.dumps(_entry(i)) for i in range(3)) + "\n")
    a.write_text("\n".join(json.dumps({"id": f"mine_{i}", "ground_truth": [
        {"get_weather": {"city": ["Paris"], "unit": ["", "c"]}}]}) for i in range(3)) + "\n")
    cases = load_cases(None, q, a)
    assert [c.id for c in cases] == ["mine_0", "mine_1", "mine_2"]
    assert cases[0].category == "custom" and cases[0].checker_category == "simple_python"
    assert score_output(cases[0], '{"name": "get_weather", "arguments": {"city": "Paris"}}').valid
    assert not score_output(cases[0], '{"name": "get_weather", "arguments": {"city": "Rome"}}').valid


def test_user_file_json_array_inline_answers(tmp_path):
    entries = []
    for i in range(2):
        e = _entry(i)
        e["ground_truth"] = [{"get_weather": {"city": ["Paris"]}}, {"get_weather": {"city": ["Rome"]}}]
        entries.append(e)
    p = tmp_path / "cases.json"
    p.write_text(json.dumps(entries))
    cases = load_file(p)
    assert cases[1].checker_category == "parallel"
    out = '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert score_output(cases[1], out).valid


def test_bfcl_ids_keep_their_category(tmp_path):
    src = load_bundled("live_multiple")[0]
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"id": src.id, "question": [src.messages], "function": src.functions,
                             "ground_truth": src.answer}) + "\n")
    assert load_file(p)[0].category == "live_multiple"


@pytest.mark.parametrize("content,msg", [
    ("{not json", "not valid JSON"),
    ('{"id": "x", "question": [[{"role": "user", "content": "hi"}]]}', "lacks 'function'"),
    ('{"id": "x", "question": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],'
     ' "function": []}', "multi-turn"),
])
def test_malformed_files(tmp_path, content, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text(content + "\n")
    with pytest.raises(DataError, match=msg):
        load_file(p)


def test_missing_answers_and_files(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text(json.dumps(_entry(0)) + "\n")
    with pytest.raises(DataError, match="no possible answer"):
        load_cases(None, p)
    with pytest.raises(DataError, match="not found"):
        load_cases(None, tmp_path / "missing.jsonl")


@pytest.mark.slow
def test_user_dataset_is_evaluated_whole_unless_a_split_is_given(tmp_path, cli):
    # a user's own file: every case by default (the hashed eval split would silently drop ~25%)
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps({**_entry(i), "ground_truth": [{"get_weather": {"city": ["Paris"]}}]})
                              for i in range(23)))
    whole = cli("eval", "--dataset", str(path), "--report-only", "--out", str(tmp_path / "a"))
    assert whole.returncode == 0, whole.stderr
    assert f"23 of 23 cases from {path}: every case (split all)" in whole.stderr
    split = cli("eval", "--dataset", str(path), "--split", "eval", "--limit", "5", "--report-only",
                "--out", str(tmp_path / "b"))
    assert split.returncode == 0, split.stderr
    n_eval = sum(1 for i in range(23) if split_of(f"mine_{i}") == "eval")
    assert 5 < n_eval < 23     # the split really drops some of these ids, so the default matters
    assert f"5 of 23 cases from {path}: the eval split (hashed case ids) keeps {n_eval}, --limit 5" in split.stderr


@pytest.mark.slow
def test_eval_records_the_engine_settings_and_refuses_bad_hysteresis(tmp_path, cli):
    """--hysteresis / --compact reach the run manifest (a directory made with other settings is
    refused, not mixed); an out-of-range --hysteresis is a one-line error."""
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({**_entry(0), "ground_truth": [{"get_weather": {"city": ["Paris"]}}]}) + "\n")
    out = tmp_path / "run"
    made = cli("eval", "--dataset", str(path), "--report-only", "--hysteresis", "0", "--no-compact", "--out", str(out))
    assert made.returncode == 0, made.stderr
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["hysteresis"] == 0.0 and manifest["compact"] is False
    other = cli("eval", "--dataset", str(path), "--report-only", "--out", str(out))
    assert other.returncode != 0 and "different settings (hysteresis, compact)" in other.stderr
    bad = cli("eval", "--dataset", str(path), "--report-only", "--hysteresis", "0.9", "--out", str(tmp_path / "x"))
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "--hysteresis must be in [0, 0.5]" in bad.stderr
