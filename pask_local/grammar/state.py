"""A llama.cpp GBNF grammar sampler with its parser state exported by patch 0003 (pask-grammar.h).

``GrammarState`` owns one ``llama_sampler`` made by ``llama_sampler_init_grammar``. It answers
"is this token accepted next?" (single token or first of a list), accepts tokens, and reads the
active pushdown stacks as rule ids (top first) plus the rule names that upstream llama.cpp drops
after parsing. Rejected tokens are reported, never passed to upstream accept (which aborts).
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np

from ..errors import NativeError, SchemaError
from ..native import NativeHandle, bind

_INT32_P = ctypes.POINTER(ctypes.c_int32)


@cache
def _fns() -> dict[str, object]:
    vp = ctypes.c_void_p
    return {
        "n_rules": bind("pask_grammar_n_rules", ctypes.c_int32, [vp]),
        "rule_name": bind("pask_grammar_rule_name", ctypes.c_char_p, [vp, ctypes.c_int32]),
        "n_stacks": bind("pask_grammar_n_stacks", ctypes.c_int32, [vp]),
        "stacks_flat": bind("pask_grammar_stacks_flat", ctypes.c_int32, [vp, _INT32_P, ctypes.c_int32]),
        "accepts": bind("pask_grammar_accepts", ctypes.c_bool, [vp, ctypes.c_int32]),
        "first_accepted": bind("pask_grammar_first_accepted", ctypes.c_int32, [vp, _INT32_P, ctypes.c_int32]),
        "accept": bind("pask_grammar_accept", ctypes.c_int32, [vp, ctypes.c_int32]),
    }


def _raw():
    import llama_cpp.llama_cpp as raw

    return raw


class GrammarState(NativeHandle):
    """One grammar sampler over ``vocab`` (a llama_vocab pointer) and its exported parser state."""

    def __init__(self, vocab, grammar_text: str, root: str = "root") -> None:
        raw = _raw()
        self._fn = _fns()
        self._ptr = raw.llama_sampler_init_grammar(vocab, grammar_text.encode(), root.encode())
        if not self._ptr:
            raise SchemaError("llama.cpp rejected the generated grammar (see PASK_VERBOSE=1 output)")
        self._vp = ctypes.cast(self._ptr, ctypes.c_void_p)
        self.n_vocab: int = raw.llama_vocab_n_tokens(vocab)
        n = self._fn["n_rules"](self._vp)
        if n < 0:
            raise NativeError("pask_grammar_n_rules failed on a grammar sampler")
        self.rule_names: list[str] = [self._fn["rule_name"](self._vp, i).decode() for i in range(n)]
        self._buf = (ctypes.c_int32 * 256)()

    def _release(self, ptr) -> None:
        _raw().llama_sampler_free(ptr)

    @property
    def ptr(self):
        return self._ptr

    # --- queries (no state change) ---
    def accepts(self, token: int) -> bool:
        return bool(self._fn["accepts"](self._vp, int(token)))

    def first_accepted(self, tokens: np.ndarray) -> int:
        """Index of the first accepted token of ``tokens`` (int32, in order), or -1."""
        arr = np.ascontiguousarray(tokens, dtype=np.int32)
        return int(self._fn["first_accepted"](self._vp, arr.ctypes.data_as(_INT32_P), len(arr)))

    def stacks(self) -> list[list[int]]:
        """The active stacks as rule ids, top first (an empty stack: the grammar may end here)."""
        n = self._fn["stacks_flat"](self._vp, self._buf, len(self._buf))
        if n < 0:
            raise NativeError("pask_grammar_stacks_flat failed")
        if n > len(self._buf):
            self._buf = (ctypes.c_int32 * (2 * n))()
            n = self._fn["stacks_flat"](self._vp, self._buf, len(self._buf))
        flat = self._buf[:n]
        out, i = [], 0
        while i < n:
            depth = flat[i]
            out.append(list(flat[i + 1:i + 1 + depth]))
            i += 1 + depth
        return out

    def named_stacks(self) -> list[list[str]]:
        return [[self.rule_names[r] for r in s] for s in self.stacks()]

    def can_end(self) -> bool:
        return any(len(s) == 0 for s in self.stacks())

    def is_done(self) -> bool:
        """The grammar is complete and cannot continue (its only stack is empty)."""
        st = self.stacks()
        return all(len(s) == 0 for s in st)

    # --- state change ---
    def accept(self, token: int) -> None:
        if self._fn["accept"](self._vp, int(token)) != 0:
            raise NativeError(f"grammar rejected token {token}")

    def full_filter(self, logits: np.ndarray) -> np.ndarray:
        """Upstream filtering over the whole vocabulary: logits with rejected tokens at -inf."""
        raw = _raw()
        n = len(logits)
        if n != self.n_vocab:  # upstream reads every id's piece: an id past the vocabulary aborts
            raise NativeError(f"full_filter needs one logit per token ({self.n_vocab}), got {n}")
        data = np.empty(n, dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
        data["id"] = np.arange(n, dtype=np.int32)
        data["logit"] = logits
        data["p"] = 0.0
        arr = raw.llama_token_data_array(
            data=data.ctypes.data_as(ctypes.POINTER(raw.llama_token_data)), size=n, selected=-1, sorted=False)
        raw.llama_sampler_apply(self._ptr, ctypes.byref(arr))
        return data["logit"].copy()
