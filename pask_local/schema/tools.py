"""Normalises tool definitions (OpenAI tools, bare JSON Schema, BFCL functions) into ``ToolSpec``s.

Accepted inputs (a single item or a list): ``{"type": "function", "function": {name, description,
parameters}}``, a function object ``{name, description, parameters}`` (OpenAI or BFCL; BFCL types
``integer, float, string, boolean, array, tuple, dict, any`` are mapped to JSON Schema), or a bare
JSON Schema object (``{"type": "object", "properties": ...}``; the tool is named after its
``title``, else ``respond``). Parameters are converted into a normalised JSON Schema subset that
``gbnf`` turns into a grammar and ``jsonschema`` validates against. Anything outside the subset
raises ``SchemaError`` naming the keyword and its JSON path.

Hostile-input limits (``docs/limits.md``) bound time and memory before any grammar is built:
``MAX_TOOLS`` tools, ``MAX_DEPTH`` nested object/array levels, ``MAX_NODES`` schema nodes in all,
``MAX_ENUM`` values per enum, ``MAX_PROPERTIES`` per object, ``MAX_TEXT_BYTES`` per description
or enum string, ``MAX_KEY_BYTES`` per property name and ``MAX_INPUT_BYTES`` for a tool file.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

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
# keywords the grammar ignores (kept for the prompt); the numeric bounds among them are still checked by
# jsonschema on the finished call
ANNOTATION_KEYS = {"description", "title", "default", "examples", "format", "$comment", "optional",
                   "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
SUPPORTED_KEYS = ANNOTATION_KEYS | {"type", "properties", "required", "items", "enum", "const",
                                    "additionalProperties", "minItems", "maxItems"}
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,127}$")

# limits on hostile or accidental huge inputs (documented in docs/limits.md)
MAX_TOOLS = 256              # tools in one request
MAX_DEPTH = 16               # nested object/array levels inside one tool's parameters
MAX_NODES = 4096             # schema nodes over the whole tool list
MAX_ENUM = 1024              # values of one enum
MAX_PROPERTIES = 256         # properties of one object
MAX_TEXT_BYTES = 64 * 1024   # UTF-8 bytes of one description, title or enum string
MAX_KEY_BYTES = 256          # UTF-8 bytes of one property name
MAX_INPUT_BYTES = 8 << 20    # a tool file / JSON string


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
        out += f"[{p}]" if p.isdigit() else f".{_printable(p, 40)}"
    return out if len(out) <= 160 else out[:60] + "..." + out[-90:]  # deep paths: both ends


def _printable(text: str, limit: int) -> str:
    """``text`` for a one-line message: non-printable characters escaped, cut at ``limit``."""
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:limit])
    return out + ("..." if len(text) > limit else "")


class _Budget:
    """Counts schema nodes over one tool list (``MAX_NODES``)."""

    def __init__(self) -> None:
        self.nodes = 0

    def take(self, where: str) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise SchemaError(f"the tool schemas have more than {MAX_NODES} nodes in all (at {where}); "
                              "see docs/limits.md")


def _check_text(value: Any, what: str, where: str, limit: int = MAX_TEXT_BYTES) -> None:
    """A string must be valid Unicode (no lone surrogates: it is tokenized as UTF-8) and short enough."""
    if not isinstance(value, str):
        return
    try:
        n = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise SchemaError(f"{what} at {where} is not valid Unicode (a lone surrogate)") from None
    if n > limit:
        raise SchemaError(f"{what} at {where} is longer than {limit} bytes; see docs/limits.md")


def _check_annotation(value: Any, what: str, where: str) -> None:
    """An annotation (default, examples, ...) is shown in the prompt: bounded like a description."""
    if isinstance(value, str):
        _check_text(value, what, where)
        return
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise SchemaError(f"{what} at {where} is not a plain JSON value") from None
    _check_text(text, what, where)


def normalise_schema(schema: Any, path: tuple[str, ...] = (), root: str = "$",
                     budget: _Budget | None = None, depth: int = 0) -> dict[str, Any]:
    """A JSON Schema (or BFCL schema) node -> a normalised node of the supported subset.

    ``path``/``root`` locate the node in the input for error messages (``$[0].function.parameters...``);
    ``budget``/``depth`` enforce ``MAX_NODES``/``MAX_DEPTH``.
    """
    where = _path(path, root)
    budget = budget or _Budget()
    budget.take(where)
    if depth > MAX_DEPTH:
        raise SchemaError(f"schema at {where} is nested more than {MAX_DEPTH} levels deep; see docs/limits.md")
    if not isinstance(schema, dict):
        raise SchemaError(f"schema at {where} must be an object, got {type(schema).__name__}")
    for key in schema:
        if key not in SUPPORTED_KEYS:
            raise SchemaError(f"unsupported schema keyword '{_printable(str(key), 60)}' at {where}")
    for key in ANNOTATION_KEYS:
        if key in schema:
            _check_annotation(schema[key], f"'{key}'", where)
    types = _types(schema, where)
    if types == ["array"]:
        schema = _enum_of_items(schema)
    out: dict[str, Any] = {k: schema[k] for k in ANNOTATION_KEYS if k in schema and k != "optional"}
    if "const" in schema:
        out["enum"] = [schema["const"]]
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"'enum' at {where} must be a non-empty list")
        if len(values) > MAX_ENUM:
            raise SchemaError(f"'enum' at {where} has {len(values)} values (at most {MAX_ENUM}); see docs/limits.md")
        for v in values:
            if isinstance(v, dict | list):
                raise SchemaError(f"'enum' at {where}: only scalar values are supported")
            if isinstance(v, float) and not math.isfinite(v):
                raise SchemaError(f"'enum' at {where}: {v} is not a JSON number")
            _check_text(v, "an 'enum' value", where)
        out["enum"] = list(values)
    if types is not None:
        out["type"] = types[0] if len(types) == 1 else types
    if "enum" in out and types is not None and "any" not in types \
            and not all(_fits_types(v, types) for v in out["enum"]):
        # The listed values govern, as in llama.cpp's json-schema-to-grammar (it reads 'enum' before
        # 'type'): real tool lists declare e.g. type integer with enum ["1", ..., "dontcare"] (BFCL live).
        # The normalised node's type becomes the values' own, so prompt, grammar and checks agree.
        types = list(dict.fromkeys(_json_type(v) for v in out["enum"]))
        out["type"] = types[0] if len(types) == 1 else types
    single = types[0] if types is not None and len(types) == 1 else None
    if single == "object" or (types is None and "properties" in schema):
        out["type"] = "object"
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"'properties' at {where} must be an object")
        if len(props) > MAX_PROPERTIES:
            raise SchemaError(f"'properties' at {where} has {len(props)} entries (at most {MAX_PROPERTIES}); "
                              "see docs/limits.md")
        for k in props:
            _check_text(k, "a property name", where, MAX_KEY_BYTES)
        out["properties"] = {str(k): normalise_schema(v, (*path, "properties", str(k)), root, budget, depth + 1)
                             for k, v in props.items()}
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"'required' at {where} must be a list of property names")
        for r in required:
            if r not in out["properties"]:  # JSON Schema: a required key with no schema takes any value
                _check_text(r, "a property name", where, MAX_KEY_BYTES)
                if len(out["properties"]) >= MAX_PROPERTIES:
                    raise SchemaError(f"'properties' at {where} has more than {MAX_PROPERTIES} entries with "
                                      "'required'; see docs/limits.md")
                budget.take(where)
                out["properties"][r] = {}
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
            out["items"] = normalise_schema(items, (*path, "items"), root, budget, depth + 1)
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
            raise SchemaError(f"unsupported type '{_printable(n, 60)}' at {where}")
        out.append(t)
    compound = [t for t in out if t in ("object", "array")]
    if compound and len(out) > 1:
        raise SchemaError(f"type lists with 'object'/'array' are unsupported at {where}")
    return out


def _enum_of_items(schema: dict[str, Any]) -> dict[str, Any]:
    """An array's ``enum`` of scalars, BFCL's arrays of choices (``metrics: {type: array, items: {type:
    string}, enum: [...]}``), means each item is one of them: the enum moves to ``items`` (unless
    ``items`` has its own)."""
    values, items = schema.get("enum"), schema.get("items", {})
    if not (isinstance(values, list) and values and isinstance(items, dict) and "enum" not in items
            and not any(isinstance(v, dict | list) for v in values)):
        return schema
    return {**{k: v for k, v in schema.items() if k != "enum"}, "items": {**items, "enum": values}}


def _fits_types(value: Any, types: list[str]) -> bool:
    """Whether a scalar enum value is an instance of one of ``types`` (a bool is not a number)."""
    return _json_type(value) in types or (_json_type(value) == "integer" and "number" in types)


def _json_type(value: Any) -> str:
    """The JSON Schema type name of a scalar value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return "number" if isinstance(value, float) else "string"


def _short(value: Any, limit: int = 60) -> str:
    """A value for an error message: JSON, ASCII-only (control characters escaped), cut at ``limit``."""
    text = json.dumps(value, ensure_ascii=True) if not isinstance(value, str) else json.dumps(value)
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[:limit] + "..."


def _tool_from_function(fn: dict[str, Any], where: str, budget: _Budget | None = None) -> ToolSpec:
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise SchemaError(f"tool at {where} needs a 'name' (letters, digits, _ . -; at most 128), got {_short(name)}")
    desc = fn.get("description", "")
    if desc is None:
        desc = ""
    if not isinstance(desc, str):
        raise SchemaError(f"'description' of tool '{name}' must be a string")
    _check_text(desc, f"the description of tool '{name}'", where)
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise SchemaError(f"'parameters' of tool '{name}' must be an object")
    norm = normalise_schema(params, ("parameters",), where, budget)
    if norm.get("type") != "object":
        raise SchemaError(f"'parameters' of tool '{name}' must have type 'object' (or BFCL 'dict')")
    norm.setdefault("properties", {})
    norm.setdefault("required", [])
    return ToolSpec(name=name, description=desc, parameters=norm, source=fn)


def _check_parameters(spec: ToolSpec) -> None:
    """What jsonschema will validate calls against must itself be valid (e.g. "maximum": "x"). Run
    after every tool is normalised: the meta-schema check is the slow part, so a list over the size
    limits is refused before any of it runs."""
    try:
        jsonschema.Draft202012Validator.check_schema(spec.parameters)
    except jsonschema.SchemaError as exc:
        raise SchemaError(f"'parameters' of tool '{spec.name}' are not a valid JSON Schema at "
                          f"{_printable(exc.json_path, 120)}: {_printable(exc.message, 120)}") from None


def _tool_from_item(item: Any, where: str, budget: _Budget | None = None) -> ToolSpec:
    if not isinstance(item, dict):
        raise SchemaError(f"tool definition at {where} must be a JSON object, got {type(item).__name__}")
    if item.get("type") == "function" and "function" in item:
        if not isinstance(item["function"], dict):
            raise SchemaError(f"'function' at {where} must be an object")
        return _tool_from_function(item["function"], where + ".function", budget)
    if "name" in item:
        return _tool_from_function(item, where, budget)
    if item.get("type") == "object" or "properties" in item:  # bare JSON Schema
        title = item.get("title", "respond")
        name = re.sub(r"[^A-Za-z0-9_]+", "_", str(title)).strip("_") or "respond"
        if not NAME_RE.match(name):
            name = "respond"
        fn = {"name": name, "description": item.get("description", ""),
              "parameters": {k: v for k, v in item.items() if k not in ("title", "$schema")}}
        spec = _tool_from_function(fn, where, budget)
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
    if len(items) > MAX_TOOLS:
        raise SchemaError(f"{len(items)} tools given, at most {MAX_TOOLS} are supported; see docs/limits.md")
    budget = _Budget()
    specs = [_tool_from_item(item, f"$[{i}]" if isinstance(data, list) else "$", budget)
             for i, item in enumerate(items)]
    for spec in specs:
        _check_parameters(spec)
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise SchemaError(f"duplicate tool name '{s.name}'")
        seen.add(s.name)
    return specs


def parse_tools(text: str) -> list[ToolSpec]:
    """Tools from a JSON string."""
    if len(text) > MAX_INPUT_BYTES:
        raise SchemaError(f"tool definitions are larger than {MAX_INPUT_BYTES >> 20} MiB; see docs/limits.md")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(f"tool definitions are not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise SchemaError("tool definitions are nested too deeply to parse; see docs/limits.md") from None
    return load_tools(data)


def read_tools(path: str | Path) -> list[ToolSpec]:
    """Tools from a JSON file."""
    p = Path(path)
    try:
        if p.is_file() and p.stat().st_size > MAX_INPUT_BYTES:
            raise SchemaError(f"tool file {p} is larger than {MAX_INPUT_BYTES >> 20} MiB; see docs/limits.md")
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SchemaError(f"cannot read tool file {p}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise SchemaError(f"tool file {p} is not UTF-8 text (byte {exc.start})") from None
    return parse_tools(text)


def as_tools(tools: Any) -> list[ToolSpec]:
    """Accept ToolSpecs, parsed JSON or a JSON string."""
    if isinstance(tools, list) and tools and all(isinstance(t, ToolSpec) for t in tools):
        return tools
    if isinstance(tools, str):
        return parse_tools(tools)
    return load_tools(tools)
