"""Golden tests: per-token classes of prompts and of calls (real Gemma tokenizer and grammar).

Generated side: a known call text is tokenised and fed through the tagger (which advances the
real grammar), so the expected classes are fixed by the schema, not by what the model writes.
Letters: S gen_struct, N gen_name, K gen_key, R gen_value_required, O gen_value_optional, W gen_ws.
"""

from __future__ import annotations

import pytest
from grammar_helpers import gemma
from test_schema_tools import EXAMPLES

from pask_local.classes import StructuralClass as C
from pask_local.grammar.state import GrammarState
from pask_local.schema.gbnf import build_grammar
from pask_local.schema.tools import read_tools
from pask_local.tagging.generated import CallTagger
from pask_local.tagging.prompt import render_prompt

L = {"S": C.GEN_STRUCT, "N": C.GEN_NAME, "K": C.GEN_KEY, "R": C.GEN_VALUE_REQUIRED,
     "O": C.GEN_VALUE_OPTIONAL, "W": C.GEN_WS}

CALENDAR = (
    '{"name": "create_event", "arguments": {"title": "Standup", "when": {"date": "2024-05-01", "time": "09:30"}, '
    '"priority": "high", "attendees": [{"name": "Ann"}, {"name": "Bo", "email": "b@x.io"}]}}',
    [('{"', "S"), ("name", "S"), ('":', "S"), (' "', "S"), ("create", "N"), ("_", "N"), ("event", "N"),
     ('",', "S"), (' "', "S"), ("arguments", "S"), ('":', "S"), (' {"', "S"),
     ("title", "K"), ('":', "S"), (' "', "S"), ("Stand", "R"), ("up", "R"), ('",', "S"), (' "', "S"),
     ("when", "K"), ('":', "S"), (' {"', "S"), ("date", "K"), ('":', "S"), (' "', "S"),
     *[(c, "R") for c in "2024-05-01"], ('",', "S"), (' "', "S"), ("time", "K"), ('":', "S"), (' "', "S"),
     *[(c, "O") for c in "09:30"], ('"},', "S"), (' "', "S"), ("priority", "K"), ('":', "S"), (' "', "S"),
     ("high", "O"), ('",', "S"), (' "', "S"), ("attend", "K"), ("ees", "K"), ('":', "S"), (' [{"', "S"),
     ("name", "K"), ('":', "S"), (' "', "S"), ("Ann", "O"), ('"},', "S"), (' {"', "S"), ("name", "K"),
     ('":', "S"), (' "', "S"), ("Bo", "O"), ('",', "S"), (' "', "S"), ("email", "K"), ('":', "S"), (' "', "S"),
     ("b", "O"), ("@", "O"), ("x", "O"), (".", "O"), ("io", "O"), ('"', "S"), ("}]", "S"), ("}}", "S")],
)
PARALLEL = (
    '[{"name": "add_to_cart", "arguments": {"item": "apple", "quantity": 2}}, '
    '{"name": "get_price", "arguments": {"item": "coffee"}}]',
    [("[", "S"), ('{"', "S"), ("name", "S"), ('":', "S"), (' "', "S"), ("add", "N"), ("_", "N"), ("to", "N"),
     ("_", "N"), ("cart", "N"), ('",', "S"), (' "', "S"), ("arguments", "S"), ('":', "S"), (' {"', "S"),
     ("item", "K"), ('":', "S"), (' "', "S"), ("apple", "R"), ('",', "S"), (' "', "S"), ("quantity", "K"),
     ('":', "S"), (" ", "W"), ("2", "R"), ("}},", "S"), (' {"', "S"), ("name", "S"), ('":', "S"), (' "', "S"),
     ("get", "N"), ("_", "N"), ("price", "N"), ('",', "S"), (' "', "S"), ("arguments", "S"), ('":', "S"),
     (' {"', "S"), ("item", "K"), ('":', "S"), (' "', "S"), ("coffee", "R"), ('"', "S"), ("}}]", "S")],
)
WEATHER = (
    '{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}',
    [('{"', "S"), ("name", "S"), ('":', "S"), (' "', "S"), ("get", "N"), ("_", "N"), ("weather", "N"), ('",', "S"),
     (' "', "S"), ("arguments", "S"), ('":', "S"), (' {"', "S"), ("location", "K"), ('":', "S"), (' "', "S"),
     ("Paris", "R"), ('",', "S"), (' "', "S"), ("unit", "K"), ('":', "S"), (' "', "S"), ("c", "O"),
     ("elsius", "O"), ('"}}', "S")],
)


@pytest.mark.parametrize("file,case,parallel", [
    ("calendar.json", CALENDAR, False),          # nested object, array of objects, enum, optional params
    ("parallel_shopping.json", PARALLEL, True),  # parallel calls, integers
    ("get_weather.json", WEATHER, False),        # enum + optional
])
def test_generated_classes(file: str, case: tuple, parallel: bool) -> None:
    m = gemma()
    text, expected = case
    tools = read_tools(EXAMPLES / file)
    g = build_grammar(tools, parallel=parallel)
    st = GrammarState(m.vocab, g.text)
    tagger = CallTagger(m, g, st)
    toks = m.tokenize(text, add_special=False, parse_special=False)
    got = [(m.piece(t).decode(), tagger.accept(t, m.piece(t)).value) for t in toks]
    assert st.is_done()
    assert got == [(p, L[c].value) for p, c in expected]


def _classes_of(prompt, needle: str) -> list[tuple[str, str]]:
    """(piece, class) of the tokens covering the first occurrence of ``needle`` in the prompt text."""
    m = gemma()
    text = prompt.text.encode()
    start = text.index(needle.encode())
    end = start + len(needle.encode())
    out, pos = [], 0
    for t, c in zip(prompt.tokens[1:], prompt.classes[1:], strict=True):
        p = m.piece(t)
        if pos < end and pos + len(p) > start:
            out.append((p.decode(), c.value))
        pos += len(p)
    return out


def test_prompt_classes_weather() -> None:
    m = gemma()
    tools = read_tools(EXAMPLES / "get_weather.json")
    p = render_prompt(m, tools, "How warm is it in Lyon?")
    assert p.style == "plain" and p.tokens[0] == m.bos and p.classes[0] == C.SINK
    assert len(p.tokens) == len(p.classes)
    assert p.tokens[1:] == m.tokenize(p.text, add_special=False, parse_special=False)
    assert _classes_of(p, '{"name": "get_weather"') == [
        ("{\"", "schema_punct"), ("name", "schema_punct"), ("\":", "schema_punct"), (" \"", "schema_punct"),
        ("get", "tool_name"), ("_", "tool_name"), ("weather", "tool_name"), ("\",", "schema_punct")]
    assert _classes_of(p, '"location": {"type": "string"') == [
        (" {\"", "schema_punct"), ("location", "param_required"), ("\":", "schema_punct"), (" {\"", "schema_punct"),
        ("type", "schema_punct"), ("\":", "schema_punct"), (" \"", "schema_punct"), ("string", "param_type"),
        ("\",", "schema_punct")]
    assert [c for _, c in _classes_of(p, '"unit"')] == ["schema_punct", "param_name", "schema_punct"]
    assert {c for _, c in _classes_of(p, "celsius")} == {"param_type"}
    assert {c for _, c in _classes_of(p, "City name, e.g. Paris")} == {"description"}
    assert {c for _, c in _classes_of(p, '"required": ["location"]')} == {"schema_punct", "param_required"}
    assert {c for _, c in _classes_of(p, "How warm is it in Lyon?")} == {"query"}
    assert {c for _, c in _classes_of(p, "Tools:")} == {"template"}


def test_prompt_examples_and_straddling() -> None:
    m = gemma()
    tools = read_tools(EXAMPLES / "get_weather.json")
    call = '{"name": "get_weather", "arguments": {"location": "Oslo"}}'
    p = render_prompt(m, tools, "Weather in Rome", examples=[("Weather in Oslo", call)])
    assert {c for _, c in _classes_of(p, "in Oslo")} == {"example"}
    assert [c for _, c in _classes_of(p, "Weather in Rome")][-2:] == ["query", "query"]
    # "\nCall: " (template) is followed by the example call: a token spanning both takes the more
    # protective class (template ranks above example)
    pieces = _classes_of(p, "Call: {")
    assert pieces[-1][1] in ("template", "example")
    for piece, cls in pieces:
        if piece.strip() and "{" in piece and ":" in piece:
            assert cls == "template"
