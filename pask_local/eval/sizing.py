"""One context size for every method, sized from the longest case of the run.

Full KV allocates one llama context for the whole run; the KV-budget methods size theirs per case
(prompt + max_tokens) up to the model's trained context. A fixed Full-KV context (it was 8192) made
Full KV fail a long prompt that the compressed methods then answered, and the comparison scored
them on different cases. ``size_context`` sizes Full KV's context from the longest case that fits
the model's trained context; a case that does not fit is skipped for *every* method and listed
(``skipped.json`` in the output directory, one line each in ``results.md``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CELL_ALIGN = 256  # llama.cpp pads a context's cells to this; sizing to it wastes nothing
SKIPPED_FILE = "skipped.json"


@dataclass(frozen=True)
class Skipped:
    """A case no method runs: its prompt and the answer room exceed the model's trained context."""

    id: str
    n_prompt: int
    max_tokens: int
    n_ctx_train: int

    def line(self) -> str:
        return (f"skipped {self.id}: prompt {self.n_prompt} + max_tokens {self.max_tokens} tokens exceed the "
                f"model's context ({self.n_ctx_train} tokens)")


def size_context(lengths: dict[str, int], max_tokens: int, n_ctx_train: int,
                 align: int = CELL_ALIGN) -> tuple[int, list[Skipped]]:
    """(n_ctx for Full KV, the cases skipped for every method) from each case's prompt tokens.

    n_ctx holds the longest fitting prompt + ``max_tokens``, rounded up to ``align`` but never past
    ``n_ctx_train`` (the check every engine run makes, ``Engine.prepare``)."""
    skipped = [Skipped(cid, n, max_tokens, n_ctx_train) for cid, n in lengths.items() if n + max_tokens > n_ctx_train]
    fitting = [n + max_tokens for cid, n in lengths.items() if n + max_tokens <= n_ctx_train]
    need = max(fitting, default=max_tokens + 1)
    return min(-(-need // align) * align, n_ctx_train), skipped


def save_skipped(out: Path, skipped: list[Skipped]) -> None:
    """Add ``skipped`` to the output directory's list (a resumed run keeps the earlier ones)."""
    known = {s.id: s for s in load_skipped(out)}
    known.update({s.id: s for s in skipped})
    (out / SKIPPED_FILE).write_text(json.dumps([s.__dict__ for s in known.values()], indent=1) + "\n")


def load_skipped(out: Path) -> list[Skipped]:
    path = out / SKIPPED_FILE
    if not path.is_file():
        return []
    try:
        data: Any = json.loads(path.read_text())
        return [Skipped(str(d["id"]), int(d["n_prompt"]), int(d["max_tokens"]), int(d["n_ctx_train"])) for d in data]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # an unreadable list is rebuilt by the next run that sizes its cases
