"""The slot pool's prefix cache: where a new request starts, and which prefixes free streams still hold.

A finished request's stream keeps its KV (``hold``). A new request asks ``lookup`` for a start: the
free stream holding the longest prefix of its prompt, or, if a running request shares a longer one, a
copy of that request's stream cut at the shared length (``Start.copy_from``); ``None`` means wait,
the running request has not decoded the shared part yet. ``claim`` takes the chosen stream out of
the cache; the pool then does the KV operations (cut, copy).

Exact by default (``reuse="exact"``): a prefix is reused only where that equals the request's own
fresh prefill. It must be held whole (never compressed under the other request), the request's
method must read a prefix with full attention (Full KV, or a method that compresses only after the
whole prompt), and the reuse ends at a multiple of the chunk, so the rest is read in the chunks of a
fresh prefill. ``reuse="any"`` also lets methods that evict while they read start from what another
request's run kept, and reuses the whole common prefix: faster, but the output may then differ.
Under ``min_reuse`` shared tokens a request starts fresh. With sliding-window layers a stream that
ran past the window no longer holds what a request at the prefix's end attends: it is not reused.

Pinned prefixes (``pin``: a prefix file, ``pask-local compress``) were compressed from the prefix
alone, independently of any request, so any mode reuses them, whole, for a request of their method
and budget whose prompt goes on past them: the pool restores one into the request's stream
(``Start.pinned``) unless a held or running stream offers a longer prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import PaskError

REUSE_MODES = ("exact", "any")  # prefix reuse: only where it equals a fresh prefill, or any held prefix


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


@dataclass(frozen=True)
class Source:
    """A running request's stream, as the cache sees it."""

    seq: int
    prompt: Sequence[int]
    n_seq: int                # positions its stream holds now
    full: bool                # Full KV: it never drops a position
    whole: bool               # it compresses only after its whole prompt (until then it holds it whole)
    last_chunk: int           # where its prompt's last chunk starts (a whole-prompt method compresses there)
    started: bool             # a step has run since its admission (its stream exists)
    cancelled: bool = False


Running = Sequence[Source] | Callable[[], Sequence[Source]]


@dataclass(frozen=True)
class Pinned:
    """A prefix compressed on its own (a prefix file): its tokens, the method and budget it was
    compressed with (None: Full KV), and how to put it into a stream."""

    tokens: tuple[int, ...]
    method: str
    budget: float | None
    restore: Callable[[Any, int], None]  # (the pool's context, a sequence id)


@dataclass(frozen=True)
class Start:
    """Where a request starts: its sequence, the prompt positions it already holds, the stream copied."""

    seq: int
    reuse: int = 0
    copy_from: int = -1       # a running request's sequence whose stream is copied (-1: none)
    pinned: Pinned | None = None  # a pinned prefix to restore into ``seq`` (``reuse`` = its length)

    @property
    def shared(self) -> bool:
        return self.copy_from >= 0


class PrefixCache:
    """The prompt tokens each free stream still holds, and the rule for reusing them (module doc)."""

    def __init__(self, enabled: bool = True, reuse: str = "exact", min_reuse: int = 32, chunk: int = 64,
                 window: int | None = None, holds_whole: Callable[[int, int], bool] = lambda seq, n: True) -> None:
        """``window``: the sliding window of the model's SWA layers (None: none); ``holds_whole(seq, n)``:
        every layer of ``seq``'s stream holds each position < n it can attend (read from the KV cache)."""
        if reuse not in REUSE_MODES:
            raise PaskError(f"unknown prefix reuse mode {reuse!r} ({', '.join(REUSE_MODES)})")
        self.enabled = enabled
        self.reuse = reuse
        self.min_reuse = max(1, min_reuse)
        self.chunk = chunk
        # a sliding-window layer drops positions that left its window: a stream that ran past it no
        # longer holds the window a new request at the shared prefix's end needs
        self.limit = window
        self.holds_whole = holds_whole
        self._held: dict[int, list[int]] = {}  # free seq -> the tokens its stream still holds
        self.pinned: list[Pinned] = []

    def pin(self, prefix: Pinned) -> None:
        """Offer ``prefix`` to every later request (see the module doc)."""
        self.pinned.append(prefix)

    def _pinned_for(self, tokens: Sequence[int], method: str | None, budget: float | None) -> Pinned | None:
        """The longest pinned prefix of ``tokens`` (which go on past it) for that method and budget."""
        best: Pinned | None = None
        for p in self.pinned:
            n = len(p.tokens)
            if p.method != method or p.budget != budget or len(tokens) <= n or (best and n <= len(best.tokens)):
                continue
            if common_prefix(p.tokens, tokens[:n]) == n:
                best = p
        return best

    def held(self, seq: int) -> list[int] | None:
        return self._held.get(seq)

    def hold(self, seq: int, tokens: list[int]) -> bool:
        """A finished request's stream keeps ``tokens``; False: the cache is off (clear the stream)."""
        if not self.enabled or not tokens:
            return False
        self._held[seq] = list(tokens)
        return True

    def claim(self, start: Start) -> list[int] | None:
        """``start.seq`` is taken: its entry leaves the cache (what it held, if anything)."""
        return self._held.pop(start.seq, None)

    def _reusable(self, held_len: int) -> bool:
        return self.limit is None or held_len <= self.limit

    def _aligned(self, n: int, aligned: bool) -> int:
        """``n`` floored to a multiple of the chunk when ``aligned``: the rest is read in a fresh prefill's chunks."""
        return (n // self.chunk) * self.chunk if aligned else n

    def lookup(self, tokens: Sequence[int], free: list[int], running: Running = (),
               full: bool = False, whole: bool = False, method: str | None = None,
               budget: float | None = None) -> Start | None:
        """Where a prompt starts, among the ``free`` sequences (not empty); None: wait for a running source.

        ``running``: the running requests' streams (or a function giving them, asked only when a
        prefix may be reused); ``full``: the request's method keeps all (Full KV); ``whole``: it
        prefills the whole prompt before it compresses. Both read a prefix with full attention; exact
        mode reuses only for them. ``method``/``budget``: the request's (None for Full KV), which
        pinned prefixes must match."""
        if self.reuse == "exact":
            start = self._pick(tokens, free, running, whole=True, aligned=True, reuse=full or whole)
        else:
            start = self._pick(tokens, free, running, whole=whole, aligned=False, reuse=True)
        pinned = self._pinned_for(tokens, method, budget) if self.pinned else None
        if pinned is None or (start is not None and start.reuse >= len(pinned.tokens)):
            return start
        seq = min(free, key=lambda s: (s in self._held, s))
        return Start(seq, len(pinned.tokens), pinned=pinned)

    def _pick(self, tokens: Sequence[int], free: list[int], running: Running, whole: bool,
              aligned: bool, reuse: bool) -> Start | None:
        """``whole``: only a prefix held whole; ``aligned``: it ends at a multiple of the chunk; ``reuse``
        False: none (a fresh stream)."""
        want = tokens[:-1]  # the last prompt token is always decoded (its logits)
        reuse = reuse and self.enabled
        best, best_n = -1, 0
        for seq in free if reuse else ():
            held = self._held.get(seq)
            if not held or not self._reusable(len(held)):
                continue
            n = self._aligned(common_prefix(held, want), aligned)
            if n > best_n and (not whole or self.holds_whole(seq, n)):
                best, best_n = seq, n
        if reuse and callable(running):
            running = running()
        src, src_n = self._running_source(want, running, whole) if reuse else (None, 0)
        src_n = self._aligned(src_n, aligned)
        if src is not None and src_n >= self.min_reuse and src_n > best_n:
            # wait until the source decoded the shared prefix, and a step since its admission (a
            # stream copy is carried out by the next decode: the source's own must be done)
            if not src.started or src.n_seq < src_n:
                return None
            if not whole or self.holds_whole(src.seq, src_n):  # (a whole-prompt source may have compressed)
                # into a free stream that holds no cached prefix, else the lowest
                seq = min(free, key=lambda s: (s in self._held, s))
                return Start(seq, src_n, src.seq)
        if best_n < self.min_reuse:
            return Start(min(free), 0)
        return Start(best, best_n)

    def _running_source(self, want: Sequence[int], running: Running, whole: bool) -> tuple[Source | None, int]:
        """The running request whose prompt shares the longest prefix with ``want``, and its length.
        ``whole``: only one whose stream still holds that prefix whole when it has read it (Full KV, or
        a whole-prompt method whose last chunk, where it compresses, starts after the prefix)."""
        best, best_n = None, 0
        for r in running() if callable(running) else running:
            if r.cancelled or not self._reusable(r.n_seq):
                continue
            if whole and not (r.full or r.whole):
                continue
            n = common_prefix(r.prompt, want)
            if whole and not r.full and n > r.last_chunk:
                continue
            if n > best_n and self._reusable(n):
                best, best_n = r, n
        return best, best_n
