"""``serve --prefix-dir``: compressed prefixes kept on disk across restarts.

At start every ``*.pkv`` file in the directory is opened with the checks of ``pask-local compress``'s
files (``prefix.build.open_file``: checksum, bounds, model, template, build) and pinned for the method
and budget it holds; a file that fails a check, or holds a method or K/V type this server does not
run, is skipped with one line (the directory may hold files of other models). After a request whose
method is query-agnostic and whose tools and system prompt have no pinned prefix yet, the prefix is
compressed once on a background thread (one at a time: it competes with the pool for the CPU), saved
atomically (``<digest>.pkv``) and pinned: later requests, and the server after a restart, start from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from ..engine.core import Engine
from ..engine.pool import SlotPool
from ..errors import PaskError
from ..llm import Model
from ..messages import Message
from ..methods.registry import REGISTRY
from ..prefix.build import compress, head_digest, open_file, pin, save, tools_digest
from ..prefix.file import sha256_json
from ..schema.tools import ToolSpec

Warn = Callable[[str], None]


class PrefixDir:
    """The directory's files, pinned in ``pool``; ``offer`` compresses a new prefix in the background."""

    def __init__(self, root: Path, model: Model, pool: SlotPool, kv_type: str, context_limit: int,
                 warn: Warn) -> None:
        if not root.is_dir():
            raise PaskError(f"--prefix-dir {root} is not a directory")
        self.root, self.model, self.pool = root, model, pool
        self.kv_type, self.context_limit, self.warn = kv_type, context_limit, warn
        self.known: set[str] = set()      # keys pinned or being compressed
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self.saved: list[Path] = []       # files this server wrote

    @staticmethod
    def key(tools_sha: str, system_sha: str, method: str, budget: float | None, kv_type: str) -> str:
        return sha256_json([tools_sha, system_sha, method, budget, kv_type])[:24]

    def load(self) -> int:
        """Pin every usable file of the directory; returns how many were pinned."""
        n = 0
        for path in sorted(self.root.glob("*.pkv")):
            try:
                header, blob = open_file(path, self.model)
                entry = REGISTRY.get(header.method)
                if entry is None:
                    raise PaskError(f"prefix file {path.name} holds an unknown method '{header.method}'")
                if header.n_prefix >= self.context_limit:
                    raise PaskError(f"prefix file {path.name} holds {header.n_prefix} tokens, more than a slot")
                self.pool.pin(pin(path, header, blob, self.model, header.method, header.budget, self.kv_type))
            except PaskError as exc:
                self.warn(f"--prefix-dir: skipped {path.name}: {exc}")
                continue
            self.known.add(self.key(header.tools_sha256, header.system_sha256, header.method, header.budget,
                                    header.kv_type))
            n += 1
        return n

    def offer(self, engine: Engine, messages: list[Message], tools: list[ToolSpec], parallel: bool) -> None:
        """After a request: compress its prefix once (background) unless one is pinned or running."""
        method = engine.method
        entry = REGISTRY.get(method.name)
        if not tools or entry is None or entry.query_aware:
            return
        head = _head(messages)
        budget = None if method.keeps_all else engine.cfg.budget
        key = self.key(tools_digest(tools), head_digest(head), method.name, budget, engine.cfg.kv_type)
        with self._lock:
            if key in self.known or (self._worker is not None and self._worker.is_alive()):
                return
            self.known.add(key)
            self._worker = threading.Thread(target=self._compress, args=(engine, tools, head, parallel, key),
                                            name="pask-prefix-dir", daemon=True)
            self._worker.start()

    def _compress(self, engine: Engine, tools: list[ToolSpec], head: list, parallel: bool, key: str) -> None:
        try:
            path = self.root / f"{key}.pkv"
            save(path, compress(engine, tools, head, parallel=parallel))
            header, blob = open_file(path, self.model)
            self.pool.pin(pin(path, header, blob, self.model, header.method, header.budget, self.kv_type))
            self.saved.append(path)
        except PaskError as exc:  # the request was served; only the saved prefix is missing
            self.warn(f"--prefix-dir: could not save a prefix: {exc}")

    def join(self, timeout: float | None = None) -> None:
        """Wait for a background compression (tests, shutdown)."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout)


def _head(messages: list[Message]) -> list[Message]:
    """The system messages a request starts with: what every turn of its conversation shares."""
    head = []
    for m in messages:
        if m.role != "system":
            break
        head.append(m)
    return head
