"""Resolves which GGUF file to load: a named model, a local path, or ``hf://``.

- ``--model NAME`` (``model_registry``: gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b):
  joined once from its installed PyPI part packages into ``cache_dir()/models/NAME.gguf``;
- neither ``--model`` nor ``--gguf``: the strongest installed instruct model (``default_model_name``;
  the base Gemma 3 270M with a notice when none is installed, ``$PASK_DEFAULT_MODEL`` names one);
- a local path: checked to exist and to start with the GGUF magic;
- ``hf://owner/repo/path/file.gguf``: fetched through huggingface-hub (its cache first; offline
  it says clearly that the hub is unreachable).
Every failure is a one-line ``ModelError``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

from .errors import ModelError
from .gguf_check import check_gguf_file
from .model_assembly import Progress, ensure_assembled
from .model_registry import DEFAULT_MODEL_ENV, get_entry, missing_parts, pick_default_model

GGUF_MAGIC = b"GGUF"


def cache_dir() -> Path:
    """pask-local's cache root ($PASK_CACHE_DIR, else $XDG_CACHE_HOME/pask-local)."""
    root = os.environ.get("PASK_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pask-local"
    )
    return Path(root)


def model_cache_path(name: str) -> Path:
    """Where the named model is (or will be) assembled."""
    return cache_dir() / "models" / f"{get_entry(name).name}.gguf"


def named_model_path(name: str, progress: Progress | None = None) -> Path:
    """The named model's GGUF, assembled from its installed part packages on first use."""
    entry = get_entry(name)
    return ensure_assembled(entry, model_cache_path(entry.name), progress)


def model_installed(name: str) -> bool:
    """The named model is assembled in the cache, or all its part packages are installed."""
    return model_cache_path(name).is_file() or not missing_parts(get_entry(name))


def default_model_name() -> str:
    """The strongest installed instruct model ($PASK_DEFAULT_MODEL overrides; the base model with a
    notice on stderr when no instruct model is installed)."""
    name, notice = pick_default_model(model_installed, os.environ.get(DEFAULT_MODEL_ENV))
    if notice:
        print(f"notice: {notice}", file=sys.stderr)
    return name


def default_model_path() -> Path:
    """Path of the default model (``default_model_name``), assembled from its PyPI parts on first use."""
    return named_model_path(default_model_name())


@functools.cache
def file_sha256(path: Path) -> str:
    """sha256 of a (model) file, cached per path for the process."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_gguf(path: Path) -> Path:
    """Raise ModelError unless ``path`` is a readable GGUF whose header, metadata and tensor table
    are sane (``gguf_check``: no tensor data is read)."""
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelError(f"not a file: {path}")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc.strerror}") from None
    if head[:4] != GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF file (bad magic {head[:4]!r})")
    if len(head) < 8:
        raise ModelError(f"{path} is truncated (GGUF header incomplete)")
    check_gguf_file(path)
    return path


def parse_hf_uri(uri: str) -> tuple[str, str]:
    """``hf://owner/repo/sub/file.gguf`` -> (``owner/repo``, ``sub/file.gguf``)."""
    rest = uri[len("hf://"):]
    parts = [p for p in rest.split("/") if p]
    if len(parts) < 3 or not parts[-1].endswith(".gguf"):
        raise ModelError(f"bad hf:// model reference {uri!r}: expected hf://owner/repo/file.gguf")
    return f"{parts[0]}/{parts[1]}", "/".join(parts[2:])


def fetch_hf(uri: str) -> Path:
    """Download (or reuse from huggingface-hub's cache) the GGUF named by an hf:// URI."""
    repo_id, filename = parse_hf_uri(uri)
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError:
        raise ModelError("hf:// models need huggingface-hub (pip install huggingface-hub)") from None
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=filename, local_files_only=True))
    except (LocalEntryNotFoundError, EntryNotFoundError, OSError):
        pass  # not cached: go online below
    unreachable = ModelError(
        f"the Hugging Face hub is unreachable and {repo_id}/{filename} is not in the local cache "
        "(offline?); pass a local --gguf PATH"
    )
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or not _hub_reachable():
        raise unreachable
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=filename))
    except LocalEntryNotFoundError:
        raise unreachable from None
    except RepositoryNotFoundError:
        raise ModelError(f"Hugging Face repository not found: {repo_id}") from None
    except EntryNotFoundError:
        raise ModelError(f"{filename} not found in Hugging Face repository {repo_id}") from None
    except Exception as exc:  # network stack errors vary by version
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(f"could not fetch {uri}: {msg}") from None


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe of the hub endpoint, so that offline use fails in seconds, not retries."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urlparse(endpoint)
    host = parsed.hostname or "huggingface.co"
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_model(gguf: str | os.PathLike[str] | None = None, model: str | None = None) -> Path:
    """The local GGUF path for ``--gguf`` (a path or hf://) or ``--model NAME`` (at most one of
    them; neither: the default named model)."""
    if gguf is not None and str(gguf) != "" and model is not None:
        raise ModelError("give either --gguf or --model, not both")
    if model is not None:
        return check_gguf(named_model_path(model))
    if gguf is None or str(gguf) == "":
        return check_gguf(default_model_path())
    text = str(gguf)
    if text.startswith("hf://"):
        return check_gguf(fetch_hf(text))
    return check_gguf(Path(text).expanduser())
