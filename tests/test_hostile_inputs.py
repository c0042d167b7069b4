"""scripts/hostile_inputs.py in the suite: every hostile input (template payloads, broken GGUFs, bad
policies, schemas, messages and traces) through the real ``pask-local`` is answered as a safe CLI
answers: exit status 1, one ``error: ...`` line with the row's expected text, no traceback, no side
effect (the template payloads' marker file never appears)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

SCRIPT = REPO / "scripts" / "hostile_inputs.py"


def test_every_hostile_input_is_one_error_line(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], capture_output=True, text=True, timeout=1800)
    rows = json.loads(out.read_text())
    assert len(rows) == 17, r.stdout + r.stderr
    for row in rows:
        assert row["exit"] == 1, row
        assert row["stderr_lines"] == 1 and row["error"].startswith("error: "), row
        assert row["expect"] in row["error"], row
        assert not row["traceback"] and not row["side_effect"], row
    assert r.returncode == 0 and r.stdout.strip().endswith("17 passed, 0 failed"), r.stdout + r.stderr
