"""A short soak of the real server (scripts/soak_serve.py as a subprocess, Qwen2.5-Coder-0.5B): five
cycles of the request mix, every good reply a schema-valid call, every bad one its 4xx, no failed
request in the server, resident memory within 5% of the warm-up's. The 1,000-request run is the
same script with --requests 1000 (docs/server.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


def test_short_soak_passes_every_check(qwen05_path, tmp_path) -> None:
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "soak_serve.py"), "--gguf", str(qwen05_path),
                           "--requests", "55", "--concurrency", "3", "--slots", "3", "--threads", "1",
                           "--max-seconds", "900", "--json", str(out)],
                          capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["requests"] == 55 and all(res["checks"].values())
    assert res["by_kind"]["drop_stream"] == {"pass": 5} and res["by_kind"]["bad_json"] == {"pass": 5}
    assert res["server_errors"] == 0
