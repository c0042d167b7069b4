"""Normalises tool definitions (OpenAI tools, bare JSON Schema, BFCL functions) into ``ToolSpec``s.

Accepted inputs (a single item or a list): ``{"type": "function", "function": {name, description,
parameters}}``, a function object ``{name, description, parameters}`` (OpenAI or BFCL; BFCL types
``integer, float, string, boolean, array, tuple, dict, any`` are mapped to JSON Schema), or a bare
JSON Schema object (``{"type": "object", "properties": ...}``; the tool is named after its
``title``, else ``respond``). Parameters are converted into a normalised JSON Schema subset that
``gbnf`` turns into a grammar and ``jsonschema`` validates against. Anything outside the subset
raises ``SchemaError`` naming the keyword and its JSON path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SchemaError

# BFCL / loose type names -> JSON Schema type names
TYPE_ALIASES = {
    "integer": "integer", "int": "integer",
    "number": "number", "float": "number", "double": "number",
    "string": "string", "str": "string",
    "boolean": "boolean", "bool": "boolean",
    "array": "array", "list": "array", "tuple": "array",
    "object": "object", "dict": "object",
    "null": "null",
    "any": "any",
}
# keywords that carry no constraint (kept for the prompt, ignored by the grammar)
ANNOTATION_KEYS = {"description", "title", "default", "examples", "format", "$comment", "optional"}
SUPPORTED_KEYS = ANNOTATION_KEYS | {"type", "properties", "required", "items", "enum", "const",
                                    "additionalProperties", "minItems", "maxItems"}
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,127}$")


@dataclass
class ToolSpec:
    """One callable tool: its name, description and normalised JSON Schema parameters."""

    name: str
    description: str
    parameters: dict[str, Any]
    source: dict[str, Any] = field(repr=False, default_factory=dict)  # the definition as given

    def required(self) -> list[str]:
        return list(self.parameters.get("required", []))


def _path(parts: Iterable[str], root: str = "$") -> str:
    out = root
    for p in parts:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def normalise_schema(schema: Any, path: tuple[str, ...] = (), root: str = "$") -> dict[str, Any]:
    """A JSON Schema (or BFCL schema) node -> a normalised node of the supported subset.

    ``path``/``root`` locate the node in the input for error messages (``$[0].function.parameters...``).
    """
    where = _path(path, root)
    if not isinstance(schema, dict):
        raise SchemaError(f"schema at {where} must be an object, got {type(schema).__name__}")
    for key in schema:
        if key not in SUPPORTED_KEYS:
            raise SchemaError(f"unsupported schema keyword '{key}' at {where}")
    out: dict[str, Any] = {k: schema[k] for k in ANNOTATION_KEYS if k in schema and k != "optional"}
    if "const" in schema:
        out["enum"] = [schema["const"]]
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"'enum' at {where} must be a non-empty list")
        for v in values:
            if isinstance(v, dict | list):
                raise SchemaError(f"'enum' at {where}: only scalar values are supported")
        out["enum"] = list(values)
    types = _types(schema, where)
    if types is not None:
        out["type"] = types[0] if len(types) == 1 else types
    if "enum" in out and types is not None and "any" not in types:
        out["enum"] = [_coerce_enum(v, types, where) for v in out["enum"]]
    single = types[0] if types is not None and len(types) == 1 else None
    if single == "object" or (types is None and "properties" in schema):
        out["type"] = "object"
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"'properties' at {where} must be an object")
        out["properties"] = {str(k): normalise_schema(v, (*path, "properties", str(k)), root) for k, v in props.items()}
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"'required' at {where} must be a list of property names")
        for r in required:
            if r not in out["properties"]:
                raise SchemaError(f"'required' at {where} names '{r}', which is not in 'properties'")
        out["required"] = list(dict.fromkeys(required))
        extra = schema.get("additionalProperties", None)
        if extra not in (None, True, False):
            raise SchemaError(f"unsupported schema keyword 'additionalProperties' (a schema) at {where}")
        if extra is not None:
            out["additionalProperties"] = extra
    elif "properties" in schema or "required" in schema:
        raise SchemaError(f"'properties'/'required' at {where} need type 'object'")
    if single == "array":
        if "items" in schema:
            items = schema["items"]
            if isinstance(items, list):  # BFCL-style tuple items: one schema for all when uniform
                raise SchemaError(f"unsupported schema keyword 'items' (a list) at {where}")
            out["items"] = normalise_schema(items, (*path, "items"), root)
        for k in ("minItems", "maxItems"):
            if k in schema:
                v = schema[k]
                if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > 64:
                    raise SchemaError(f"'{k}' at {where} must be an integer in 0..64")
                out[k] = v
        if out.get("minItems", 0) > out.get("maxItems", 64):
            raise SchemaError(f"'minItems' > 'maxItems' at {where}")
    elif "items" in schema or "minItems" in schema or "maxItems" in schema:
        raise SchemaError(f"'items'/'minItems'/'maxItems' at {where} need type 'array'")
    if types is not None and "any" in types:
        out.pop("type", None)  # JSON Schema: no 'type' means any value
        if len(types) > 1:
            raise SchemaError(f"type 'any' cannot be combined with other types at {where}")
    rank = {k: i for i, k in enumerate(schema)}  # keep the source's key order (for the prompt)
    rank.setdefault("enum", rank.get("const", len(rank)))
    return dict(sorted(out.items(), key=lambda kv: rank.get(kv[0], len(rank))))


def _types(schema: dict[str, Any], where: str) -> list[str] | None:
    if "type" not in schema:
        return None
    raw = schema["type"]
    names = raw if isinstance(raw, list) else [raw]
    if not names or not all(isinstance(n, str) for n in names):
        raise SchemaError(f"'type' at {where} must be a type name or a list of type names")
    out = []
    for n in names:
        t = TYPE_ALIASES.get(n.lower())
        if t is None:
            raise SchemaError(f"unsupported type '{n}' at {where}")
        out.append(t)
    compound = [t for t in out if t in ("object", "array")]
    if compound and len(out) > 1:
        raise SchemaError(f"type lists with 'object'/'array' are unsupported at {where}")
    return out


def _coerce_enum(value: Any, types: list[str], where: str) -> Any:
    """BFCL enums of numbers are sometimes given as strings; keep values valid for the type."""
    ok = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None)}
    for t in types:
        want = ok.get(t)
        if want is not None and isinstance(value, want) and not (t in ("integer", "number") and isinstance(value, bool)):
            return value
    raise SchemaError(f"'enum' value {json.dumps(value)} at {where} does not match type {'/'.join(types)}")


def _tool_from_function(fn: dict[str, Any], where: str) -> ToolSpec:
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise SchemaError(f"tool at {where} needs a 'name' (letters, digits, _ . -), got {name!r}")
    desc = fn.get("description", "")
    if not isinstance(desc, str):
        raise SchemaError(f"'description' of tool '{name}' must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise SchemaError(f"'parameters' of tool '{name}' must be an object")
    norm = normalise_schema(params, ("parameters",), where)
    if norm.get("type") != "object":
        raise SchemaError(f"'parameters' of tool '{name}' must have type 'object' (or BFCL 'dict')")
    norm.setdefault("properties", {})
    norm.setdefault("required", [])
    return ToolSpec(name=name, description=desc, parameters=norm, source=fn)


def _tool_from_item(item: Any, where: str) -> ToolSpec:
    if not isinstance(item, dict):
        raise SchemaError(f"tool definition at {where} must be a JSON object, got {type(item).__name__}")
    if item.get("type") == "function" and "function" in item:
        if not isinstance(item["function"], dict):
            raise SchemaError(f"'function' at {where} must be an object")
        return _tool_from_function(item["function"], where + ".function")
    if "name" in item:
        return _tool_from_function(item, where)
    if item.get("type") == "object" or "properties" in item:  # bare JSON Schema
        title = item.get("title", "respond")
        name = re.sub(r"[^A-Za-z0-9_]+", "_", str(title)).strip("_") or "respond"
        if not NAME_RE.match(name):
            name = "respond"
        fn = {"name": name, "description": item.get("description", ""),
              "parameters": {k: v for k, v in item.items() if k not in ("title", "$schema")}}
        spec = _tool_from_function(fn, where)
        spec.source = item
        return spec
    raise SchemaError(f"tool definition at {where} is neither an OpenAI tool, a function nor a JSON Schema object")


def load_tools(data: Any) -> list[ToolSpec]:
    """Tools from parsed JSON (a dict, a list, or ``{"tools": [...]}``) -> ToolSpecs (validated)."""
    if isinstance(data, dict) and isinstance(data.get("tools"), list):
        data = data["tools"]
    items = data if isinstance(data, list) else [data]
    if not items:
        raise SchemaError("the tool list is empty")
    specs = [_tool_from_item(item, f"$[{i}]" if isinstance(data, list) else "$") for i, item in enumerate(items)]
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise SchemaError(f"duplicate tool name '{s.name}'")
        seen.add(s.name)
    return specs


def parse_tools(text: str) -> list[ToolSpec]:
    """Tools from a JSON string."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(f"tool definitions are not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    return load_tools(data)


def read_tools(path: str | Path) -> list[ToolSpec]:
    """Tools from a JSON file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SchemaError(f"cannot read tool file {p}: {exc.strerror}") from None
    return parse_tools(text)


def as_tools(tools: Any) -> list[ToolSpec]:
    """Accept ToolSpecs, parsed JSON or a JSON string."""
    if isinstance(tools, list) and tools and all(isinstance(t, ToolSpec) for t in tools):
        return tools
    if isinstance(tools, str):
        return parse_tools(tools)
    return load_tools(tools)
