"""For each byte value, a token of the model's vocabulary whose text is exactly that byte (or -1).

The generated-token tagger advances the grammar byte by byte through these tokens. ASCII bytes
are found by tokenising single characters; the other bytes (byte-fallback tokens) by one scan of
the vocabulary, done only when such a byte is first needed. Cached per model file.
"""

from __future__ import annotations

from .llm import Model

_CACHE: dict[str, list[int]] = {}
_FULL: set[str] = set()


def byte_tokens(model: Model, full: bool = False) -> list[int]:
    key = str(model.path)
    got = _CACHE.get(key)
    if got is None:
        got = [-1] * 256
        for b in range(1, 128):
            ids = model.tokenize(chr(b), add_special=False, parse_special=False)
            if len(ids) == 1 and model.piece(ids[0]) == bytes([b]) and not model.is_eog(ids[0]):
                got[b] = ids[0]
        _CACHE[key] = got
    if full and key not in _FULL:
        for t in range(model.n_vocab):
            p = model.piece(t)
            if len(p) == 1 and got[p[0]] < 0 and p[0] != 0 and not model.is_eog(t):
                got[p[0]] = t
        _FULL.add(key)
    return got
