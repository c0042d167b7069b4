"""The hostile-HTTP probe, fast form, against a real `pask-local serve` subprocess on 127.0.0.1.

``scripts/hostile_http.py --fast`` starts the server (Gemma 3 270M, --api-key, short timeouts, a small
connection limit) and sends what an outside tester sends: a cross-site text/plain POST, foreign Host
headers, missing and wrong keys, 5,000-digit integers, 4 concurrent 4-MiB bodies, a slowloris
client, a body that never finishes, a client gone mid-body, more connections than allowed. Every
row must be what a safe server answers, and the server's log must hold no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


def test_fast_probe_passes_every_row(tmp_path, gemma_path):
    out = tmp_path / "hostile.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "hostile_http.py"), "--fast", "--gguf",
                           str(gemma_path), "--json", str(out)], capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text()) if out.exists() else []
    failed = [r for r in rows if not r["ok"]]
    assert proc.returncode == 0 and rows and not failed, (failed, proc.stdout[-3000:], proc.stderr[-2000:])
    probes = " ".join(r["probe"] for r in rows)
    for needle in ("text/plain", "DNS rebinding", "no API key", "5,000 digits", "MiB of words", "slowloris",
                   "never finishes", "mid-body", "held connections", "server log"):
        assert needle in probes, needle
