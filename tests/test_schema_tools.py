"""Tool normalisation and bad input: clear SchemaErrors, no crash (no model needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pask_local.errors import SchemaError
from pask_local.schema.gbnf import build_grammar
from pask_local.schema.tools import load_tools, parse_tools, read_tools

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def fn(params: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "description": "d", "parameters": params}}


def test_invalid_json() -> None:
    with pytest.raises(SchemaError, match="not valid JSON.*line 1"):
        parse_tools('{"name": "f", ')


def test_schema_not_an_object() -> None:
    with pytest.raises(SchemaError, match=r"\$\[0\].*must be a JSON object"):
        load_tools(["get_weather"])
    with pytest.raises(SchemaError, match=r"schema at \$\.parameters\.properties\.x must be an object"):
        load_tools({"name": "f", "parameters": {"type": "object", "properties": {"x": "string"}}})


@pytest.mark.parametrize("keyword,schema,path", [
    ("anyOf", {"anyOf": [{"type": "string"}]}, "$.function.parameters.properties.x"),
    ("pattern", {"type": "string", "pattern": "^a+$"}, "$.function.parameters.properties.x"),
    ("$ref", {"$ref": "#/defs/a"}, "$.function.parameters.properties.x"),
])
def test_unsupported_keyword_names_keyword_and_path(keyword: str, schema: dict, path: str) -> None:
    with pytest.raises(SchemaError) as err:
        load_tools(fn({"type": "object", "properties": {"x": schema}}))
    assert f"'{keyword}'" in str(err.value)
    assert path in str(err.value)


def test_nested_unsupported_keyword_path() -> None:
    params = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object", "properties": {
        "b": {"type": "string", "pattern": "^x$"}}}}}}
    with pytest.raises(SchemaError, match=r"'pattern' at \$\[1\]\.function\.parameters\.properties\.a\.items\.properties\.b"):
        load_tools([fn({"type": "object"}, "g"), fn(params)])


def test_empty_tool_list() -> None:
    with pytest.raises(SchemaError, match="empty"):
        load_tools([])
    with pytest.raises(SchemaError, match="empty"):
        parse_tools('{"tools": []}')


def test_duplicate_tool_names() -> None:
    with pytest.raises(SchemaError, match="duplicate tool name 'f'"):
        load_tools([fn({"type": "object"}), fn({"type": "object"})])


def test_required_must_be_names_and_bad_types() -> None:
    with pytest.raises(SchemaError, match="'required' at .* must be a list of property names"):
        load_tools(fn({"type": "object", "properties": {"x": {"type": "string"}}, "required": [1]}))
    with pytest.raises(SchemaError, match="unsupported type 'complex'"):
        load_tools(fn({"type": "object", "properties": {"x": {"type": "complex"}}}))
    with pytest.raises(SchemaError, match="needs a 'name'"):
        load_tools({"type": "function", "function": {"name": "bad name!", "parameters": {}}})


def test_bfcl_types_are_mapped() -> None:
    spec = read_tools(EXAMPLES / "bfcl_math.json")[0]
    assert spec.parameters["type"] == "object"
    tool = load_tools({"name": "g", "parameters": {"type": "dict", "properties": {
        "f": {"type": "float"}, "t": {"type": "tuple", "items": {"type": "string"}},
        "a": {"type": "any"}, "d": {"type": "dict", "properties": {"k": {"type": "integer"}}}}}})[0]
    props = tool.parameters["properties"]
    assert props["f"]["type"] == "number"
    assert props["t"]["type"] == "array"
    assert "type" not in props["a"]
    assert props["d"]["type"] == "object"


def test_bare_schema_and_examples_load() -> None:
    spec = load_tools({"title": "Person record", "type": "object", "properties": {"age": {"type": "integer"}}})[0]
    assert spec.name == "Person_record"
    for path in sorted(EXAMPLES.glob("*.json")):
        specs = read_tools(path)
        assert specs, path
        text = build_grammar(specs, parallel=True).text
        for s in specs:
            assert f"\\\"{s.name}\\\"" in text


def _grammar_takes(grammar_text: str, text: str) -> bool:
    """llama.cpp's grammar engine (the oracle) reads ``text`` byte by byte and can end after it."""
    from grammar_helpers import gemma

    from pask_local._byte_tokens import byte_tokens
    from pask_local.grammar.state import GrammarState

    m = gemma()
    bt = byte_tokens(m, full=True)
    st = GrammarState(m.vocab, grammar_text)
    try:
        for b in text.encode():
            if not st.accepts(bt[b]):
                return False
            st.accept(bt[b])
        return st.can_end()
    finally:
        st.close()


def test_enum_values_govern_a_type_they_do_not_match() -> None:
    # BFCL live_parallel_multiple (real user tools): "type": "integer" with enum ["1", ..., "dontcare"].
    # Like llama.cpp's json-schema-to-grammar (which reads 'enum' before 'type'), the listed values are
    # what may be generated; the whole tool list is not refused over one inconsistent parameter.
    (spec,) = load_tools(fn({"type": "object", "required": ["n"], "properties": {
        "n": {"type": "integer", "enum": ["1", "2", "dontcare"]},
        "m": {"type": "integer", "enum": [1, "x"]},
        "k": {"type": "number", "enum": [1, 2.5]}}}))
    props = spec.parameters["properties"]
    assert props["n"] == {"type": "string", "enum": ["1", "2", "dontcare"]}
    assert props["m"] == {"type": ["integer", "string"], "enum": [1, "x"]}
    assert props["k"] == {"type": "number", "enum": [1, 2.5]}  # an integer is a number: left as given
    g = build_grammar([spec]).text
    call = '{{"name": "f", "arguments": {{"n": {}}}}}'
    assert _grammar_takes(g, call.format('"dontcare"')) and _grammar_takes(g, call.format('"2"'))
    assert not _grammar_takes(g, call.format("2")) and not _grammar_takes(g, call.format('"3"'))
    assert _grammar_takes(g, '{"name": "f", "arguments": {"n": "1", "m": "x"}}')
    assert not _grammar_takes(g, '{"name": "f", "arguments": {"n": "1", "m": "1"}}')


@pytest.mark.slow
def test_every_bfcl_tool_list_of_the_eight_categories_loads() -> None:
    # the real bfcl-eval data: before enum values governed, 3 of live_parallel_multiple's cases were
    # refused outright (a SchemaError for every method, Full KV's included)
    from pask_local.eval.data import CATEGORIES, load_bundled

    n = 0
    for cat in CATEGORIES:
        for case in load_bundled(cat):
            build_grammar(load_tools(case.functions))
            n += 1
    assert n > 1000
    (case,) = [c for c in load_bundled("live_parallel_multiple") if c.id == "live_parallel_multiple_18-16-0"]
    (house,) = [t for t in load_tools(case.functions) if t.name == "Hotels_2_SearchHouse"]
    assert house.parameters["properties"]["number_of_adults"]["enum"][-1] == "dontcare"


def test_array_enums_required_without_schema_and_bounds_are_read_as_written() -> None:
    (spec,) = load_tools(fn({"type": "object", "required": ["metrics", "pop"], "properties": {
        "metrics": {"type": "array", "items": {"type": "string"}, "enum": ["co2", "noise"]},
        "fee": {"type": "integer", "maximum": 400},
        "pop": {"type": "dict", "required": ["adults"]}}}))
    props = spec.parameters["properties"]
    assert props["metrics"] == {"type": "array", "items": {"type": "string", "enum": ["co2", "noise"]}}
    assert props["fee"] == {"type": "integer", "maximum": 400}
    assert props["pop"] == {"type": "object", "properties": {"adults": {}}, "required": ["adults"]}
    g = build_grammar([spec]).text
    call = '{{"name": "f", "arguments": {{"metrics": {}, "pop": {}}}}}'
    assert _grammar_takes(g, call.format('["co2", "noise"]', '{"adults": 2}'))
    assert _grammar_takes(g, call.format('[]', '{"adults": "any JSON"}'))
    assert not _grammar_takes(g, call.format('["co3"]', '{"adults": 2}'))  # items keep the enum
    assert not _grammar_takes(g, call.format('["co2"]', '{}'))  # the required key stays required
    assert _grammar_takes(g, '{"name": "f", "arguments": {"metrics": [], "pop": {"adults": 1}, "fee": 9999}}')


@pytest.mark.parametrize("bad,keyword", [({"type": "integer", "maximum": "x"}, "maximum"),
                                         ({"type": "string", "format": 3}, "format"),
                                         ({"type": "string", "examples": "a"}, "examples")])
def test_parameters_jsonschema_cannot_check_calls_against_are_refused_in_one_line(bad: dict, keyword: str) -> None:
    # the normalised parameters are what jsonschema validates each finished call against: a malformed
    # annotation used to pass load_tools and end in jsonschema's own SchemaError (a traceback) later
    with pytest.raises(SchemaError) as err:
        load_tools(fn({"type": "object", "properties": {"a": bad}}))
    msg = str(err.value)
    assert msg.startswith("'parameters' of tool 'f' are not a valid JSON Schema at ") and keyword in msg
    assert "\n" not in msg and len(msg) < 400
