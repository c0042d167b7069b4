"""The fast constrained sampler picks exactly what upstream full filtering + argmax picks."""

from __future__ import annotations

import numpy as np
import pytest
from grammar_helpers import gemma, gemma_ctx
from test_schema_tools import EXAMPLES

from pask_local.grammar.sampler import ConstrainedSampler, full_filter_greedy
from pask_local.grammar.state import GrammarState
from pask_local.schema.gbnf import build_grammar
from pask_local.schema.tools import read_tools
from pask_local.tagging.prompt import render_prompt

pytestmark = pytest.mark.slow


def test_greedy_equals_full_filter_on_random_logits() -> None:
    """Random logits make the argmax almost always rejected: exercises blocks and the full filter."""
    m = gemma()
    tools = read_tools(EXAMPLES / "calendar.json")
    g = build_grammar(tools)
    rng = np.random.default_rng(7)
    st = GrammarState(m.vocab, g.text)
    smp = ConstrainedSampler(st, block=16, n_blocks=2)
    steps = 0
    while not st.is_done() and steps < 40:
        logits = rng.standard_normal(m.n_vocab).astype(np.float32) * 3
        # favour the grammar's own continuation a bit so that the call can finish
        ref = full_filter_greedy(st, logits)
        got = smp.greedy(logits)
        assert got == ref
        st.accept(got)
        steps += 1
    assert smp.stats.block + smp.stats.full > 0  # the slow paths were really taken
    # ties: equal logits everywhere -> the lowest accepted id, as numpy.argmax after filtering
    st2 = GrammarState(m.vocab, g.text)
    flat = np.zeros(m.n_vocab, dtype=np.float32)
    assert ConstrainedSampler(st2).greedy(flat) == full_filter_greedy(st2, flat)


def test_greedy_decode_identical_to_full_filter_decode() -> None:
    m = gemma()
    ctx = gemma_ctx()
    tools = read_tools(EXAMPLES / "calendar.json")
    g = build_grammar(tools)
    prompt = render_prompt(m, tools, "Create a meeting called Budget review on 2024-06-03 at 10:00 with Ann.")
    runs = []
    for mode in ("fast", "full"):
        st = GrammarState(m.vocab, g.text)
        smp = ConstrainedSampler(st)
        ctx.clear()
        assert ctx.decode(prompt.tokens, 0) == 0
        logits, pos, out = ctx.logits(), len(prompt.tokens), []
        for _ in range(80):
            tok = smp.greedy(logits) if mode == "fast" else full_filter_greedy(st, logits)
            if m.is_eog(tok):
                break
            st.accept(tok)
            out.append(tok)
            if st.is_done():
                break
            assert ctx.decode([tok], pos) == 0
            pos += 1
            logits = ctx.logits()
        runs.append(out)
    assert runs[0] == runs[1]
    assert len(runs[0]) > 10
