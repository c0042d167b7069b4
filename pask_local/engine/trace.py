"""Writes the engine's trace (docs/trace-format.md): what persisted in which layer group, step by step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO


class TraceWriter:
    """JSON Lines writer; a no-op when constructed with ``path=None``."""

    def __init__(self, path: str | Path | None) -> None:
        self._f: TextIO | None = open(path, "w", encoding="utf-8") if path else None  # noqa: SIM115

    @property
    def enabled(self) -> bool:
        return self._f is not None

    def write(self, kind: str, **fields: Any) -> None:
        if self._f is not None:
            self._f.write(json.dumps({"type": kind, **fields}, ensure_ascii=False) + "\n")
            if kind in ("header", "step", "final"):
                self._f.flush()  # live viewers tail the file

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
