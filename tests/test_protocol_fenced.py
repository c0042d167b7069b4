"""Fenced calls under tool_choice auto (Qwen2.5-Coder writes ```json blocks instead of <tool_call>):
the fenced grammar on llama.cpp's grammar engine, ``Plan.parse``, the decoder's second opener and
the reply streamer, on the synthetic Hermes-template model of ``test_protocol_native``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from serve_helpers import deltas_of
from test_protocol_native import CONVO, TOOLS, TOOLS_TEMPLATE, _model
from test_schema_tools import _grammar_takes

from pask_local.chat.decoder import Decoder
from pask_local.chat.protocol import plan
from pask_local.classes import StructuralClass as C
from pask_local.messages import ToolChoice, parse_messages
from pask_local.schema.gbnf import build_fenced_grammar
from pask_local.server.streaming import ReplyStreamer
from pask_local.tagging.native import call_format, fence_match

WEATHER = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
PRETTY = '{\n  "name": "get_time",\n  "arguments": {"zone": "CET"}\n}'


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    m = _model(tmp_path_factory, TOOLS_TEMPLATE, "fenced")
    yield m
    m.close()


def test_fence_match_only_at_the_start() -> None:
    assert fence_match("```json\n{") and fence_match("  \n```json") and fence_match("```\n{")
    for undecided in ("", "  \n", "`", "``", "```", "```js", "```\n"):
        assert fence_match(undecided) is None, undecided
    for no in ("Sure: ```json", "```python\n", "```\nls -la", "`ls`", "<tool_call>"):
        assert fence_match(no) is False, no
    fmt = call_format(TOOLS_TEMPLATE)
    assert fmt is not None and fmt.fences


def test_fenced_grammar_oracle() -> None:
    """llama.cpp's grammar engine reads fenced calls byte by byte (Gemma's byte tokens)."""
    one = build_fenced_grammar(TOOLS).text
    assert _grammar_takes(one, f"```json\n{WEATHER}\n```")
    assert _grammar_takes(one, f"```\n{PRETTY}\n```")                # bare fence, pretty outer object
    assert not _grammar_takes(one, '```json\n{"name": "rm_rf", "arguments": {}}\n```')         # unknown tool
    assert not _grammar_takes(one, '```json\n{"name": "get_weather", "arguments": {}}\n```')   # city missing
    assert not _grammar_takes(one, '```json\n{"name": "get_weather", "arguments": {"unit": "celsius"}}\n```')
    assert not _grammar_takes(one, f"```json\n{WEATHER}\n```\nDone.")  # text after the closing fence
    assert not _grammar_takes(one, f"```json\n{WEATHER}\n```\n```json\n{PRETTY}\n```")  # one call only
    assert not _grammar_takes(one, f"```python\n{WEATHER}\n```")
    two = build_fenced_grammar(TOOLS, parallel=True, max_calls=2).text
    assert _grammar_takes(two, f"```json\n{WEATHER}\n```\n\n```json\n{PRETTY}\n```\n")
    assert not _grammar_takes(two, f"```json\n{WEATHER}\n```\nand\n```json\n{PRETTY}\n```")
    assert not _grammar_takes(two, "\n".join([f"```json\n{WEATHER}\n```"] * 3))  # max_calls


def test_parse_fenced_replies(tools_model) -> None:
    p = plan(tools_model, TOOLS, parse_messages(CONVO), ToolChoice("auto"))
    assert p.fenced is not None
    r = p.parse(f"```json\n{PRETTY}\n```", "grammar", 64)
    assert r.error is None and r.message.content is None
    assert [(c.name, c.arguments) for c in r.message.tool_calls] == [("get_time", {"zone": "CET"})]
    r = p.parse(f"\n```\n{WEATHER}\n```\n", "eog", 64)
    assert r.error is None and [c.name for c in r.message.tool_calls] == ["get_weather"]
    prose = f"Here it is:\n```json\n{WEATHER}\n```"
    r = p.parse(prose, "eog", 64)                        # a fence after text is text
    assert r.error is None and r.message.content == prose and not r.message.tool_calls
    code = "```python\nprint(1)\n```"
    r = p.parse(code, "eog", 64)
    assert r.error is None and r.message.content == code and not r.message.tool_calls
    bad = p.parse('```json\n{"name": "get_time", "arguments": {"zone": }}\n```', "eog", 64)
    assert not bad.message.tool_calls and bad.error is not None and "not valid JSON" in bad.error
    unknown = p.parse('```json\n{"name": "rm_rf", "arguments": {}}\n```', "eog", 64)
    assert not unknown.message.tool_calls and unknown.error is not None
    two = p.parse(f"```json\n{WEATHER}\n```\n```json\n{PRETTY}\n```", "eog", 64)
    assert two.error == "expected one call, got 2"
    cut = p.parse('```json\n{"name": "get_time", "argu', "length", 64)
    assert cut.error is not None and "max_tokens" in cut.error
    # parallel: several blocks are several calls
    pp = plan(tools_model, TOOLS, parse_messages(CONVO), ToolChoice("auto"), parallel=True)
    r = pp.parse(f"```json\n{WEATHER}\n```\n\n```json\n{PRETTY}\n```", "eog", 64)
    assert r.error is None and [c.name for c in r.message.tool_calls] == ["get_weather", "get_time"]
    # only auto reads fences: required forces <tool_call>, none is text
    for choice in ("required", "none"):
        q = plan(tools_model, TOOLS, parse_messages(CONVO), ToolChoice(choice))
        assert q.fenced is None
        assert not q.parse(f"```json\n{WEATHER}\n```", "eog", 64).message.tool_calls


def _feed(dec: Decoder, model, text: str) -> list[C]:
    return [dec.accept(t) for t in model.tokenize(text, parse_special=False)]


def test_decoder_engages_the_fenced_grammar_only_at_the_start(tools_model) -> None:
    m = tools_model
    p = plan(m, TOOLS, parse_messages(CONVO), ToolChoice("auto"))
    end = m.tokenize("<|im_end|>", parse_special=True)[0]
    dec = Decoder(m, p)
    try:
        _feed(dec, m, "\n``")
        assert not dec.constrained and dec.fence_open
        _feed(dec, m, "`json")
        assert dec.constrained and not dec.rejected
        logits = np.zeros(m.n_vocab, dtype=np.float32)
        logits[end] = 100.0
        tok = dec.choose(logits)                          # the call must follow, not the end of the reply
        assert tok != end and m.piece(tok) == b"\n"
        classes = _feed(dec, m, f"\n{WEATHER}\n```")
        assert dec.done and C.GEN_NAME in classes and C.GEN_VALUE_REQUIRED in classes
    finally:
        dec.close()
    for text in ("Sure: ```json\n{", "```python\n"):       # prose first, or a code block: stays text
        dec = Decoder(m, p)
        try:
            assert set(_feed(dec, m, text)) == {C.GEN_VALUE_OPTIONAL} and not dec.constrained
        finally:
            dec.close()
    dec = Decoder(m, p)                                   # a fenced call to an unknown tool is refused
    try:
        _feed(dec, m, "```json\n")
        assert dec.constrained
        bad = [t for t in m.tokenize('{"name": "rm', parse_special=False)]
        ok = True
        for t in bad:
            if dec.state is None or not dec.state.accepts(t):
                ok = False
                break
            dec.accept(t)
        assert not ok
    finally:
        dec.close()


def _stream(text: str, seed: int, fences: bool | None = None) -> tuple[str | None, list[tuple[str, str]]]:
    import random

    st = ReplyStreamer(True, "<tool_call>", "</tool_call>", fences)
    return deltas_of(st, text.encode(), random.Random(seed) if seed else None, 4)  # seed 0: byte by byte


@pytest.mark.parametrize("seed", range(6))
def test_reply_streamer_streams_fenced_calls(seed, tools_model) -> None:
    weather_args = json.dumps(json.loads(WEATHER)["arguments"])
    assert _stream(f"```json\n{WEATHER}\n```", seed) == (None, [("get_weather", weather_args)])
    assert _stream(f"  \n```\n{PRETTY}\n```\n", seed) == (None, [("get_time", '{"zone": "CET"}')])
    two = f"```json\n{WEATHER}\n```\n\n```json\n{PRETTY}\n```"
    assert _stream(two, seed) == (None, [("get_weather", weather_args), ("get_time", '{"zone": "CET"}')])
    # the streamed content equals the parsed reply's content, fence or not
    pp = plan(tools_model, TOOLS, parse_messages(CONVO), ToolChoice("auto"), parallel=True)
    for text in (two, f"Here:\n```json\n{WEATHER}\n```", "```python\nprint(1)\n```", "``", " ```"):
        parsed = pp.parse(text, "eog", 64)
        content, calls = _stream(text, seed)
        assert content == parsed.message.content, text
        assert [n for n, _ in calls] == [c.name for c in parsed.message.tool_calls], text
        assert [json.loads(a) for _, a in calls] == [c.arguments for c in parsed.message.tool_calls], text
    # without fences (not a fencing format) a fenced reply is content
    assert _stream(f"```json\n{WEATHER}\n```", seed, fences=False) == (f"```json\n{WEATHER}\n```", [])
