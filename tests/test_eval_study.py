"""pask_local.eval.study and ``pask-local study table``: merged directories, common cases, best baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pask_local.eval.paired import pair, sign_test
from pask_local.eval.study import StudyError, build_study, load_dirs, markdown, pair_lower

MANIFEST = {"model": "m.gguf", "split": "eval", "max_tokens": 128, "share_prefill": True}


def _rec(case: str, cat: str, method: str, budget: float | None, valid: bool, output: str = "o") -> dict:
    return {"id": case, "category": cat, "method": method, "budget": budget, "valid": valid,
            "output": output, "seconds": 2.0, "stats": {"budget_used_final": budget}}


def _write(d: Path, recs: list[dict], manifest: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "run.json").write_text(json.dumps(manifest or MANIFEST))
    (d / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"id": "cut sh')
    return d


def _table(tmp_path: Path) -> tuple[Path, Path]:
    """Two directories: full/snapkv/pask in one, streaming in the other; case c5 lacks streaming."""
    a, b = [], []
    for i in range(6):
        cat = "simple" if i < 3 else "multiple"
        a.append(_rec(f"c{i}", cat, "full", None, True, f"f{i}"))
        a.append(_rec(f"c{i}", cat, "snapkv", 0.2, i in (0, 1, 3), f"f{i}" if i < 2 else "s"))
        a.append(_rec(f"c{i}", cat, "pask-prior", 0.2, i in (0, 1, 2, 3, 4)))
        if i < 5:
            b.append(_rec(f"c{i}", cat, "streaming", 0.2, i in (0, 3, 4)))
    return _write(tmp_path / "a", a), _write(tmp_path / "b", b)


def test_merged_study_keeps_common_cases_and_pairs_with_the_best_baseline(tmp_path):
    manifest, records = load_dirs(list(_table(tmp_path)))
    # settings later versions added (policy, catalog, whole_prefill) read as None where an older run.json lacks them
    assert manifest == {"policy": None, "catalog": None, "whole_prefill": None, **{k: v for k, v in MANIFEST.items() if k != "share_prefill"}}
    st = build_study(records)
    assert st["n_cases"] == 5 and st["cases_left_out"] == 1
    assert st["cases_per_category"] == {"multiple": 2, "simple": 3}
    rows = {r["label"]: r for r in st["runs"]}
    # per-category mean: snapkv simple 2/3, multiple 1/2; streaming simple 1/3, multiple 2/2
    assert rows["snapkv@0.2"]["accuracy"] == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert rows["streaming@0.2"]["accuracy"] == pytest.approx((1 / 3 + 1) / 2)
    assert rows["pask-prior@0.2"]["retention"] == pytest.approx(1.0)
    assert rows["snapkv@0.2"]["same_as_full"] == pytest.approx(2 / 5)
    (b,) = st["budgets"]
    # streaming (0.667) beats snapkv (0.583) on these cases: it is the best baseline
    assert b["best_baseline"] == "streaming"
    (v,) = b["pask_vs_best"]
    # pask-prior right on c0-c4; streaming wrong on c1, c2
    assert (v["method"], v["wins"], v["losses"], v["n"]) == ("pask-prior", 2, 0, 5)
    assert v["points"] == pytest.approx(100 * (1 - (1 / 3 + 1) / 2), abs=0.01)
    md = markdown(st)
    assert "| 0.2 | streaming | pask-prior | +33.3 | 2/0 |" in md


def _fid(kl: float, gold_nll: float | None, n: int = 10) -> dict:
    return {"n": n, "kl": kl, "top1": 1.0 - kl, "groups": {"name": {"n": n, "kl": kl, "top1": 1.0 - kl}},
            "gold_n": 5 if gold_nll is not None else 0, "gold_nll": gold_nll,
            "gold_nll_full": 0.5 if gold_nll is not None else None}


def test_fidelity_records_add_pooled_fidelity_and_a_per_case_pairing(tmp_path):
    recs = []
    # per case KL: snapkv 0.2 everywhere; pask-prior lower on c0-c2, higher on c3; c4 has no gold call
    for i, kl in enumerate((0.1, 0.1, 0.1, 0.3, 0.1)):
        gold = None if i == 4 else 0.9
        recs += [{**_rec(f"c{i}", "simple", "full", None, True, f"f{i}"), "fidelity": _fid(0.0, None if i == 4 else 0.5)},
                 {**_rec(f"c{i}", "simple", "snapkv", 0.2, True), "fidelity": _fid(0.2, gold)},
                 {**_rec(f"c{i}", "simple", "pask-prior", 0.2, i != 3),
                  "fidelity": _fid(kl, None if gold is None else (0.7 if i < 2 else 1.2))}]
    st = build_study(load_dirs([_write(tmp_path / "f", recs)])[1])
    rows = {r["label"]: r for r in st["runs"]}
    f = rows["pask-prior@0.2"]["fidelity"]
    assert f["cases"] == 5 and f["kl"] == pytest.approx(0.14) and f["gold_cases"] == 4
    assert f["gold_dnll"] == pytest.approx((0.7 * 2 + 1.2 * 2) / 4 - 0.5)
    (v,) = st["budgets"][0]["pask_vs_best"]
    assert (v["kl"]["wins"], v["kl"]["losses"], v["kl"]["n"]) == (4, 1, 5)
    assert v["kl"]["mean_diff"] == pytest.approx(0.14 - 0.2)
    assert (v["gold_nll"]["wins"], v["gold_nll"]["losses"], v["gold_nll"]["n"]) == (2, 2, 4)
    assert v["kl"]["p"] == pytest.approx(sign_test(4, 1))
    md = markdown(st)
    assert "| pask-prior@0.2 | 0.14 | 86.0 | 0.950 | +0.450 |" in md  # KL, top-1, gold NLL, gold dNLL
    assert "| pask-prior@0.2 | 0.14 | 86.0 | 50 | 4 |" in md  # per class (name): KL, top-1; steps, gold cases
    assert "| 0.2 | snapkv | pask-prior | 4/1 | 0.375 | -0.060 | 2/2 | 1.000 | +0.050 |" in md
    tie = [{"fidelity": _fid(0.2, 0.9)}, {"fidelity": _fid(0.1, None)}, {"fidelity": None}]
    base = [{"fidelity": _fid(0.2, 0.8)}, {"fidelity": _fid(0.3, 0.5)}, {"fidelity": _fid(0.1, 0.5)}]
    k = pair_lower(tie, base, "kl")  # a tie counts for neither side; a case without fidelity is left out
    assert (k["n"], k["wins"], k["losses"]) == (2, 1, 0) and k["mean_diff"] == pytest.approx(-0.1)
    g = pair_lower(tie, base, "gold_nll")
    assert (g["n"], g["wins"], g["losses"]) == (1, 0, 1)
    plain = markdown(build_study(load_dirs(list(_table(tmp_path)))[1]))
    assert "Fidelity" not in plain and "KL" not in plain  # an accuracy-only study's table is unchanged


def test_a_run_subset_changes_the_common_cases(tmp_path):
    _, records = load_dirs(list(_table(tmp_path)))
    st = build_study(records, [("full", "full"), ("snapkv", "0.2"), ("pask-prior", "0.2")])
    assert st["n_cases"] == 6 and st["budgets"][0]["best_baseline"] == "snapkv"
    with pytest.raises(StudyError, match="no records for tova@0.2"):
        build_study(records, [("tova", "0.2")])


def test_directories_with_other_settings_are_refused(tmp_path):
    a, _ = _table(tmp_path)
    other = _write(tmp_path / "c", [_rec("c0", "simple", "h2o", 0.2, True)], {**MANIFEST, "max_tokens": 256})
    with pytest.raises(StudyError, match="other settings.*max_tokens"):
        load_dirs([a, other])
    clash = _write(tmp_path / "d", [_rec("c0", "simple", "full", None, True, "another output")])
    with pytest.raises(StudyError, match="disagree on full@full for case c0"):
        load_dirs([a, clash])


def test_pair_and_sign_test():
    a = [{"id": str(i), "valid": i < 4, "output": "x"} for i in range(6)]
    b = [{"id": str(i), "valid": i >= 3, "output": "x" if i == 0 else "y"} for i in range(6)]
    p = pair(a, b)
    assert (p.wins, p.losses, p.same_output) == (3, 2, 1)
    assert p.p == pytest.approx(sign_test(3, 2)) == pytest.approx(1.0)
    assert sign_test(0, 6) == pytest.approx(2 / 64)
    with pytest.raises(ValueError):
        pair(a, b[::-1])


def test_table_command_writes_json_table_and_plot(tmp_path, cli):
    a, b = _table(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    r = cli("study", "table", str(a), str(b), "--json", str(out / "t.json"), "--md", str(out / "t.md"),
            "--png", str(out / "t.png"))
    assert r.returncode == 0, r.stderr
    st = json.loads((out / "t.json").read_text())
    assert st["n_cases"] == 5 and st["settings"]["max_tokens"] == 128
    assert (out / "t.md").read_text() == r.stdout
    assert (out / "t.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args", [["/nonexistent"], ["{a}", "--runs", "snapkv@x"]])
def test_table_command_bad_input_is_one_line(tmp_path, cli, args):
    a, _ = _table(tmp_path)
    r = cli("study", "table", *[s.format(a=a) for s in args])
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
