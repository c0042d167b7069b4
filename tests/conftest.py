"""Shared fixtures: the embedded model path, the build script as a module, a CLI runner."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


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
    from pask_local.models import default_model_path

    return default_model_path()


def run_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the installed ``pask-local`` console script as a user would."""
    exe = Path(sys.executable).parent / "pask-local"
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, env=full_env)


@pytest.fixture
def cli():
    return run_cli
