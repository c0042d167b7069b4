"""Real engine traces for the TUI tests: `pask-local run --trace` on the embedded model, once per session.

Each (method, request) pair is run at most once per test session (cached in a temporary folder that
is removed at exit); a run that fails or writes no complete trace fails the test that asked for it.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WEATHER = REPO / "examples" / "get_weather.json"
REQUEST = "What is the weather in Paris in celsius?"
_DIR = Path(tempfile.mkdtemp(prefix="pask-tui-tests-"))
atexit.register(shutil.rmtree, _DIR, True)


@cache
def real_trace(method: str = "pask", request: str = REQUEST, schema: Path = WEATHER, budget: float = 0.33,
               max_tokens: int = 48, valid: bool = True) -> Path:
    """Path of a complete trace written by the engine for this run.

    ``valid``: the run must end in a valid call (exit status 0); with False the run may stop at
    ``max_tokens`` before the call is complete (exit status 1), but must still write its final line."""
    out = _DIR / f"{method}-{abs(hash((request, str(schema), budget, max_tokens)))}.jsonl"
    exe = Path(sys.executable).parent / "pask-local"
    proc = subprocess.run(
        [str(exe), "run", "--method", method, "--budget", str(budget), "--max-tokens", str(max_tokens),
         "--schema", str(schema), "--trace", str(out), "--stats", "--stats-json", request],
        capture_output=True, text=True, timeout=600)
    ok = proc.returncode == 0 or (not valid and proc.returncode == 1 and "not a valid call" in proc.stderr)
    if not ok or not out.is_file():
        pytest.fail(f"pask-local run --method {method} --trace failed (exit {proc.returncode}): "
                    f"{proc.stderr.strip()[-2000:]}")
    stats = [ln for ln in proc.stderr.splitlines() if ln.startswith("{")]
    if stats:
        out.with_suffix(".stats.json").write_text(stats[-1])
    out.with_suffix(".stderr.txt").write_text(proc.stderr)
    return out


def run_stderr(trace: Path) -> str:
    """What the run that wrote ``trace`` printed on stderr (its ``--stats`` table among it)."""
    return trace.with_suffix(".stderr.txt").read_text()


def run_stats(trace: Path) -> dict:
    """The engine's ``--stats-json`` of the run that wrote ``trace`` (counts read from the native cache)."""
    import json

    return json.loads(trace.with_suffix(".stats.json").read_text())
