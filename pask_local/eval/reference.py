"""Builds a known-correct JSON call list from a BFCL possible answer.

A possible answer maps each expected function to ``{param: [allowed values]}``; ``""`` among the
allowed values marks the parameter as optional. Dict-typed values are themselves ``{key: [allowed]}``
and lists of dicts hold such dicts. The reference omits every optional parameter (not required by the
function and allowed to be omitted) and takes the first allowed, non-empty value of the others. Used for few-shot examples and for checker tests.

A few BFCL answers cannot be met by any output (a required parameter with no allowed value, or an
expected parameter the function does not declare); ``unsatisfiable`` names the reason for those.
"""

from __future__ import annotations

from typing import Any

_ABSENT = object()


def _pick(options: list[Any], required: bool = False) -> Any:
    """_ABSENT when the value may be omitted (or none is allowed), else the first allowed value."""
    if "" in options and not required:
        return _ABSENT
    for opt in options:
        if opt != "":
            return _resolve(opt)
    return _ABSENT


def _resolve(value: Any) -> Any:
    if isinstance(value, dict):  # a dict value: each key maps to its own allowed values
        out = {}
        for key, options in value.items():
            got = _pick(options) if isinstance(options, list) else options
            if got is not _ABSENT:
                out[key] = got
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [_resolve(v) for v in value]
    return value


def _required(functions: list[dict[str, Any]], name: str) -> set[str]:
    for fn in functions:
        if fn.get("name") == name:
            return set(fn.get("parameters", {}).get("required", []))
    return set()


def reference_calls(functions: list[dict[str, Any]], answer: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``[{"name": f, "arguments": {...}}, ...]`` that the checker accepts for this possible answer."""
    calls = []
    for entry in answer:
        (name, params), = entry.items()
        required = _required(functions, name)
        args = {}
        for param, options in params.items():
            got = _pick(options, param in required)
            if got is not _ABSENT:
                args[param] = got
        calls.append({"name": name, "arguments": args})
    return calls


def unsatisfiable(functions: list[dict[str, Any]], answer: list[dict[str, Any]]) -> str | None:
    """Why no output can match ``answer`` (a dataset quirk), or None when the reference should pass."""
    by_name = {f["name"]: f for f in functions}
    for entry in answer:
        (name, params), = entry.items()
        fn = by_name.get(name)
        if fn is None:
            return f"expected function {name!r} is not among the case's functions"
        declared = fn.get("parameters", {}).get("properties", {})
        required = fn.get("parameters", {}).get("required", [])
        for param, options in params.items():
            if not options:
                return f"{name}.{param}: no allowed value"
            if param not in declared and "" not in options:
                return f"{name}.{param}: expected but not declared by the function"
            if param in required and all(o == "" for o in options):
                return f"{name}.{param}: required but only the 'omitted' marker is allowed"
        for param in required:
            if param not in params:
                return f"{name}.{param}: required but absent from the possible answer"
    return None
