"""Shared fixtures: the named models' paths, the build script as a module, a CLI runner."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# the product defaults to the strongest installed instruct model; the suite pins the small base model
# wherever a test runs the default (a test of the choice itself clears this)
os.environ.setdefault("PASK_DEFAULT_MODEL", "gemma3-270m")


@pytest.fixture(scope="session")
def build_script():
    """scripts/build_llama.py imported as a module (it is a standalone, stdlib-only script)."""
    spec = importlib.util.spec_from_file_location("build_llama", REPO / "scripts" / "build_llama.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["build_llama"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    from pask_local.models import named_model_path

    return named_model_path("gemma3-270m")


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (scripts/setup installs its parts: missing parts fail, not skip)."""
    from pask_local.models import named_model_path

    return named_model_path("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen15_path() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct (installed by scripts/demo; skipped when its parts are absent)."""
    from pask_local.model_registry import get_entry, missing_parts
    from pask_local.models import named_model_path

    if missing_parts(get_entry("qwen2.5-coder-1.5b")):
        pytest.skip("qwen2.5-coder-1.5b is not installed (pask-local models --install qwen2.5-coder-1.5b)")
    return named_model_path("qwen2.5-coder-1.5b")


@pytest.fixture(scope="session")
def gemma_model(gemma_path):
    """Gemma 3 270M loaded once for the whole session (contexts are made per test; nothing mutates a Model)."""
    from pask_local.llm import Model

    m = Model(gemma_path)
    yield m
    m.close()


@pytest.fixture(scope="session")
def qwen05_model(qwen05_path):
    """Qwen2.5-Coder-0.5B-Instruct loaded once for the whole session."""
    from pask_local.llm import Model

    m = Model(qwen05_path)
    yield m
    m.close()


def run_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the installed ``pask-local`` console script as a user would."""
    exe = Path(sys.executable).parent / "pask-local"
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, env=full_env)


@pytest.fixture
def cli():
    return run_cli


def evictions(trace) -> dict[tuple[int, int, str], set[int]]:
    """A trace's evictions: (step, layer, rule) -> the positions evicted."""
    out: dict[tuple[int, int, str], set[int]] = defaultdict(set)
    for line in trace.read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "evict":
            out[(rec["step"], rec["layer"], rec["rule"])] |= set(rec["positions"])
    return dict(out)


def compression(trace) -> dict[int, list[int]]:
    """A trace's one-time compression after the prompt: layer -> the positions its scores evicted."""
    return {layer: sorted(pos) for (step, layer, rule), pos in evictions(trace).items()
            if step == -1 and rule == "score"}

