"""pask_local.eval.headroom and ``pask-local study headroom``: cases split by whether Full KV's answer fits."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from pask_local.eval.headroom import answer_lengths, fits, headroom, markdown
from pask_local.eval.study import StudyError, load_dirs
from pask_local.llm import Model

MANIFEST = {"model": "m.gguf", "split": "eval", "max_tokens": 128}


def _rec(case: str, method: str, budget: float | None, valid: bool, n_prompt: int | None = 100,
         text: str = "o") -> dict:
    stats = {"raw_output": text} if n_prompt is None else {"n_prompt": n_prompt}
    return {"id": case, "category": "simple" if case < "c3" else "parallel", "method": method, "budget": budget,
            "valid": valid, "output": text, "seconds": 1.0, "stats": stats}


def _records() -> list[dict]:
    recs = []
    for i in range(5):
        recs += [_rec(f"c{i}", "full", None, True, None, f"answer {i}"),
                 _rec(f"c{i}", "snapkv", 0.2, i in (0, 1, 3)),
                 _rec(f"c{i}", "pask-prior", 0.2, i in (0, 4))]
    return recs


def test_fits_counts_the_answer_against_the_whole_sequence():
    assert fits(80, 20, 0.2) and not fits(79, 21, 0.2)  # 20 of 100 fits at 0.2, 21 of 100 does not
    assert fits(1, 0, 0.1)


def test_split_and_rights_per_part():
    recs = {(r["id"], r["method"], "full" if r["budget"] is None else f"{r['budget']:g}"): r for r in _records()}
    # c0-c2: 100 + 10 tokens (fits 0.2); c3, c4: 100 + 40 (29% of the sequence: does not)
    lengths = {f"c{i}": (100, 10 if i < 3 else 40) for i in range(5)}
    h = headroom(recs, lengths)
    (b,) = h["budgets"]
    assert (b["fit"], b["rest"], b["rest_by_category"]) == (3, 2, {"parallel": 2})
    rows = {r["label"]: r for r in b["runs"]}
    assert (rows["full"]["fit_right"], rows["full"]["rest_right"]) == (3, 2)
    assert (rows["snapkv@0.2"]["fit_right"], rows["snapkv@0.2"]["rest_right"]) == (2, 1)
    assert (rows["pask-prior@0.2"]["fit_right"], rows["pask-prior@0.2"]["rest_right"]) == (1, 1)
    assert h["mean_gen"] == pytest.approx(22.0)
    assert "| snapkv@0.2 | 2/3 (67%) | 1/2 (50%) |" in markdown(h)


def test_answer_lengths_tokenize_fulls_output(gemma_path):
    recs = {(r["id"], r["method"], "full" if r["budget"] is None else f"{r['budget']:g}"): r for r in _records()}
    model = Model(gemma_path)
    try:
        lengths = answer_lengths(recs, ["c0", "c3"], lambda t: model.tokenize(t, parse_special=True))
        assert lengths == {"c0": (100, len(model.tokenize("answer 0"))), "c3": (100, len(model.tokenize("answer 3")))}
        # a case no run prefilled (every record failed before the prompt: n_prompt 0 at the top level,
        # none in stats) has no length: left out of the split, and headroom lists it
        for key in [k for k in recs if k[0] == "c4"]:
            recs[key] = {**recs[key], "n_prompt": 0, "stats": {"raw_output": ""}, "valid": False}
        lengths = answer_lengths(recs, ["c0", "c1", "c4"], lambda t: model.tokenize(t, parse_special=True))
        assert sorted(lengths) == ["c0", "c1"] and lengths["c1"][0] == 100
        only_top = {k: {**r, "n_prompt": 77, "stats": {}} for k, r in recs.items() if k[0] == "c2"}
        assert answer_lengths(only_top, ["c2"], model.tokenize)["c2"][0] == 77  # the top-level field
        h = headroom(recs, lengths, ["c4"])
        assert h["n_cases"] == 2 and h["left_out"] == ["c4"] and "Left out: 1 case(s)" in markdown(h)
        with pytest.raises(StudyError, match="no case of the study was prefilled"):
            headroom(recs, {}, ["c4"])
        del recs[("c3", "full", "full")]
        with pytest.raises(StudyError, match="case c3 has no Full KV record"):
            answer_lengths(recs, ["c3"], model.tokenize)
    finally:
        model.close()


def test_headroom_command_writes_json_and_table(tmp_path, gemma_path):
    study = tmp_path / "study"
    for name, method in (("a", "full"), ("b", "snapkv"), ("c", "pask-prior")):
        d = study / name
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps(MANIFEST))
        (d / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records() if r["method"] == method))
    assert len(load_dirs(sorted(study.iterdir()))[1]) == 15
    r = run_cli("study", "headroom", "--gguf", str(gemma_path), str(study), timeout=300)
    assert r.returncode == 0, r.stderr
    h = json.loads((study / "headroom.json").read_text())
    assert h["n_cases"] == 5 and h["budgets"][0]["fit"] == 5  # 2-3 answer tokens of ~102: all fit 0.2
    assert (study / "headroom.md").read_text() == r.stdout
    bad = run_cli("study", "headroom", "--gguf", str(gemma_path), str(tmp_path / "none"), timeout=300)
    assert bad.returncode == 1 and bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1
