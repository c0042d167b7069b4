"""Patch 0003: the exported parser state of llama.cpp's grammar sampler, checked against oracles.

Oracles: the rule names we wrote into the GBNF text; upstream ``llama_sampler_apply`` (full filter)
for token acceptance; the grammar structure for the stack contents after known inputs.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from grammar_helpers import gemma

from pask_local.errors import NativeError
from pask_local.grammar.state import GrammarState, _fns

GBNF = 'root ::= "{" item ("," item)* "}"\nitem ::= key ":" val\nkey ::= "\\"" [a-z]+ "\\""\nval ::= [0-9]+\n'


def test_rule_names_kept() -> None:
    m = gemma()
    st = GrammarState(m.vocab, GBNF)
    names = st.rule_names
    for n in ("root", "item", "key", "val"):
        assert n in names
    # every other rule is one the GBNF parser generated from a named rule: "<parent>_<id>"
    for i, n in enumerate(names):
        if n not in ("root", "item", "key", "val"):
            base, _, num = n.rpartition("_")
            assert base in ("root", "item", "key", "val") and int(num) == i


def _ids(m, text: str) -> list[int]:
    return m.tokenize(text, add_special=False, parse_special=False)


def test_stacks_follow_input() -> None:
    m = gemma()
    st = GrammarState(m.vocab, GBNF)
    names = st.rule_names
    # at the start the only expected terminal is "{" in root
    assert [[names[r] for r in s] for s in st.stacks()] == [["root"]]
    for t in _ids(m, '{"ab'):
        st.accept(t)
    # inside the key's letters: key (or its generated repetition rule) is the innermost named frame,
    # and item (which continues with ':' after key) is below it; root continues after item
    for s in st.named_stacks():
        assert s[0].startswith("key")
        assert "item" in s and s[-1].startswith("root")
    for t in _ids(m, '":1'):
        st.accept(t)
    # "val" is in tail position of "item": upstream drops item's frame, so it is absent
    # either more digits (inside val) or "," / "}" (back in root); "val" is in tail position of
    # "item", so upstream dropped item's frame from every stack
    named = st.named_stacks()
    assert any(s[0].startswith("val") for s in named)
    assert any(s[0].startswith("root") for s in named)
    assert all("item" not in s for s in named)
    assert not st.can_end()
    for t in _ids(m, "}"):
        st.accept(t)
    assert st.stacks() == [[]] and st.is_done()


def test_accepts_matches_upstream_full_filter() -> None:
    m = gemma()
    st = GrammarState(m.vocab, GBNF)
    for t in _ids(m, '{"ab":'):
        st.accept(t)
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(m.n_vocab).astype(np.float32)
    allowed = np.isfinite(st.full_filter(logits))
    assert 0 < allowed.sum() < m.n_vocab
    sample = np.concatenate([np.flatnonzero(allowed)[:200], rng.integers(0, m.n_vocab, 300)])
    for t in sample:
        assert st.accepts(int(t)) == bool(allowed[t]), int(t)
    order = rng.permutation(sample).astype(np.int32)
    first = st.first_accepted(order)
    expect = next((i for i, t in enumerate(order) if allowed[t]), -1)
    assert first == expect


def test_rejected_token_is_reported_not_aborting() -> None:
    m = gemma()
    st = GrammarState(m.vocab, GBNF)
    before = st.stacks()
    bad = _ids(m, "x")[0]
    with pytest.raises(NativeError, match="rejected"):
        st.accept(bad)
    assert st.stacks() == before
    with pytest.raises(NativeError):
        st.accept(m.eos)  # EOG while the grammar cannot end: upstream would abort
    assert not st.accepts(-5) and not st.accepts(m.n_vocab + 10)


def test_other_samplers_are_refused() -> None:
    import llama_cpp.llama_cpp as raw

    m = gemma()
    greedy = raw.llama_sampler_init_greedy()
    fns = _fns()
    vp = ctypes.cast(greedy, ctypes.c_void_p)
    assert fns["n_rules"](vp) == -1
    assert fns["n_stacks"](vp) == -1
    assert fns["rule_name"](vp, 0) is None
    assert fns["accept"](vp, m.bos) == -1
    assert fns["n_rules"](None) == -1
    raw.llama_sampler_free(greedy)


# every byte sequence here is fed one byte-token at a time; the oracle is Python's UTF-8 decoder
UTF8_CASES = [
    b"\xf0\x90\x80\x80", b"\xe2\x80\x80", b"\xed\x9f\xbf", b"\xf4\x8f\xbf\xbf", b"\xc2\xa9",  # well-formed
    b"\xf0\x82\x80\x80",  # overlong U+2000 (upstream matched it as U+2000)
    b"\xe0\x80\x80", b"\xc0\x80", b"\xc1\xbf",                  # overlong
    b"\xed\xa0\x80",                                            # a surrogate
    b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff",           # above U+10FFFF, invalid leads
    b"\xe2\x41\x41", b"\x80",                                   # a non-continuation byte, a stray one
]


def _utf8_prefix(prefix: bytes) -> bool:
    """Oracle: some completion of ``prefix`` is well-formed UTF-8 by Python's (whole-string) decoder; the
    constraints bind the second byte only, so completing with a few continuation bytes finds one if any."""
    import itertools

    for k in range(4):
        for tail in itertools.product((0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF), repeat=k):
            try:
                (prefix + bytes(tail)).decode("utf-8")
                return True
            except UnicodeDecodeError:
                pass
    return False


@pytest.mark.parametrize("seq", UTF8_CASES, ids=lambda s: s.hex())
def test_grammar_accepts_only_well_formed_utf8(seq: bytes) -> None:
    # patch 0008: a byte is accepted inside a free string iff the bytes so far are a prefix of well-formed
    # UTF-8, so a grammar never lets invalid bytes through
    from pask_local._byte_tokens import byte_tokens

    m = gemma()
    bt = byte_tokens(m, full=True)
    st = GrammarState(m.vocab, 'root ::= "\\"" [^"\\\\]* "\\""\n')
    st.accept(bt[ord('"')])
    for i, b in enumerate(seq):
        assert bt[b] >= 0, f"no byte token for {b:#x}"
        valid = _utf8_prefix(seq[:i + 1])
        assert st.accepts(bt[b]) == valid, (seq.hex(), i)
        if not valid:
            break
        st.accept(bt[b])
    else:  # a whole well-formed character: the string can close
        assert st.accepts(bt[ord('"')])
