"""``pask-local study compare``: the paired sign test and its table, on a hand-written cases.jsonl."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pask_local.errors import PaskError
from pask_local.eval.paired import sign_test
from pask_local.study.cli import study_app


def _compare(argv: list[str]) -> int:
    """``pask-local study compare ARGV`` in-process (typer's CliRunner on the study sub-app): its exit
    status (a PaskError, the entry point's ``error:`` line, is 1); its stdout goes to ours."""
    r = CliRunner().invoke(study_app, ["compare", *argv])
    if r.exception is not None and not isinstance(r.exception, (PaskError, SystemExit)):
        raise r.exception  # a bug, not bad input
    print(r.stdout, end="")
    return r.exit_code


def test_sign_test_exact_values():
    assert sign_test(0, 5) == pytest.approx(2 / 32)      # all 5 discordant pairs one way
    assert sign_test(5, 5) == 1.0
    assert sign_test(0, 0) == 1.0
    assert sign_test(1, 9) == pytest.approx(2 * (1 + 10) / 1024)


def test_table_counts_discordant_cases(tmp_path, capsys):
    rows = []
    for i in range(6):
        rows.append({"id": f"c{i}", "method": "full", "budget": None, "valid": i < 4, "output": f"o{i}"})
        rows.append({"id": f"c{i}", "method": "pask", "budget": 0.33, "valid": i in (0, 4), "output":
                     f"o{i}" if i < 3 else "x"})
    (tmp_path / "cases.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert _compare([str(tmp_path), "pask@0.33", "full"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    # pask right & full wrong: c4; full right & pask wrong: c1, c2, c3; same output: c0, c1, c2
    assert line.startswith("| pask@0.33 | full | 6 | 33.3 | 66.7 | 1 | 3 |")
    assert line.endswith("| 50.0 |")
    assert _compare([str(tmp_path), "h2o@0.33", "full"]) == 1


def test_runs_of_another_directory_pair_by_case_id(tmp_path, capsys):
    a, b = tmp_path / "native", tmp_path / "plain"
    a.mkdir()
    b.mkdir()
    ra = [{"id": f"c{i}", "method": "full", "budget": None, "valid": i < 3, "output": f"o{i}"} for i in range(5)]
    rb = [{"id": f"c{i}", "method": "full", "budget": None, "valid": i in (0, 3), "output": f"p{i}"} for i in (4, 0, 3, 1)]
    (a / "cases.jsonl").write_text("\n".join(json.dumps(r) for r in ra) + "\n")
    (b / "cases.jsonl").write_text("\n".join(json.dumps(r) for r in rb) + "\n")
    assert _compare([str(a), "full", "full", "--b-out", str(b)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    # common ids c0, c1, c3, c4: A right on c0, c1; B right on c0, c3 -> one discordant pair each way
    assert line.startswith("| full | plain:full | 4 | 50.0 | 50.0 | 1 | 1 | 1.000 | 0.0 |")
