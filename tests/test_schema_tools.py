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
        "b": {"type": "integer", "minimum": 3}}}}}}
    with pytest.raises(SchemaError, match=r"'minimum' at \$\[1\]\.function\.parameters\.properties\.a\.items\.properties\.b"):
        load_tools([fn({"type": "object"}, "g"), fn(params)])


def test_empty_tool_list() -> None:
    with pytest.raises(SchemaError, match="empty"):
        load_tools([])
    with pytest.raises(SchemaError, match="empty"):
        parse_tools('{"tools": []}')


def test_duplicate_tool_names() -> None:
    with pytest.raises(SchemaError, match="duplicate tool name 'f'"):
        load_tools([fn({"type": "object"}), fn({"type": "object"})])


def test_required_must_exist_and_bad_types() -> None:
    with pytest.raises(SchemaError, match="names 'y'"):
        load_tools(fn({"type": "object", "properties": {"x": {"type": "string"}}, "required": ["y"]}))
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
