"""Prefixes prefilled whole, kept by their tokens: one prefill of a prefix serves many methods and budgets.

A prefix prefilled whole holds every entry of every layer. That state is the same whichever planned
method, at whichever budget, then drops what its plan does not keep (``compress --whole-prefill``),
and whichever budget a whole-prompt method (SnapKV) later compresses a request to. ``pask-local eval`` runs several methods
and budgets over the same catalog groups: ``WholePrefills`` keeps each group's whole prefill (its
saved state) so that only the first of them pays it. Bounded in bytes; the oldest is dropped first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..engine.core import Engine
from ..engine.pool import Pinned
from . import state as kv_state
from .build import Examples, Head, find_prefix, prefill_prefix


@dataclass(frozen=True)
class WholePrefix:
    """A prefix prefilled whole: its tokens, its saved state and the seconds that prefill took."""

    tokens: tuple[int, ...]
    state: bytes
    seconds: float

    def pinned(self, method: str, budget: float | None, drop_last: bool = False) -> Pinned:
        """The prefix for a pool (``SlotPool.pin``) that runs ``method`` at ``budget``. ``drop_last``:
        without its last token, which the request then decodes itself: a prompt that is this prefix
        alone (``prefix.build.compress``) must still decode a token before its plan is applied."""
        tokens = self.tokens[:-1] if drop_last else self.tokens
        state, n = self.state, len(tokens)

        def restore(ctx: Any, seq: int) -> None:
            kv_state.restore(ctx, seq, state)
            if drop_last:
                ctx.seq_rm(seq, n, -1)

        return Pinned(tokens, method, budget, restore)


class WholePrefills:
    """Whole prefills by (prefix tokens, how the method reads a prompt, K/V type); ``prefills`` counts
    those paid. A whole-prompt method reads its last chunk from its observation window's start, so its
    whole prefill differs in the last bits from a planned method's: each is served only to its own kind."""

    def __init__(self, max_bytes: int = 6 << 30) -> None:
        self.max_bytes = max_bytes
        self._held: OrderedDict[tuple, WholePrefix] = OrderedDict()
        self.prefills = 0

    def get(self, holder: Engine, tools: list[Any], head: Head, examples: Examples = None,
            parallel: bool = False) -> tuple[WholePrefix, bool]:
        """(the prefix prefilled whole by ``holder``, whether this call paid that prefill). ``holder``
        must keep every entry: its method at budget 1.0."""
        if holder.cfg.budget < 1.0:
            raise ValueError("a whole prefill's holder keeps every entry (budget 1.0)")
        tokens = tuple(find_prefix(holder, tools, head, examples, parallel).tokens)
        key = (tokens, holder.method.prefill_mode, holder.cfg.kv_type)
        if key in self._held:
            self._held.move_to_end(key)
            return self._held[key], False
        t0 = time.perf_counter()
        _, state, _, _, _ = prefill_prefix(holder, tools, head, examples, parallel, whole=True)
        whole = WholePrefix(tokens, state, time.perf_counter() - t0)
        self.prefills += 1
        self._held[key] = whole
        while len(self._held) > 1 and sum(len(w.state) for w in self._held.values()) > self.max_bytes:
            self._held.popitem(last=False)
        return whole, True
