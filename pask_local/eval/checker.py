"""Scores one model output with BFCL's official AST checker (from the ``bfcl-eval`` package).

The checker module imports ``bfcl_eval.constants.model_config``, which imports every vendor SDK's
handler. Only one value of it is used (``MODEL_CONFIG_MAPPING[name].underscore_to_dot``), so we put a
minimal stand-in for that single module into ``sys.modules`` before importing the checker; the
checker itself runs unmodified.

Our generators emit JSON calls, ``{"name": ..., "arguments": {...}}`` or a list of them. They are
converted to the checker's decoded format ``[{name: {arg: value}}]``; an output that does not parse or
has the wrong shape is scored invalid (error type ``ast_decoder:...``), never skipped.
"""

from __future__ import annotations

import functools
import json
import sys
import types
from dataclasses import dataclass
from typing import Any

from ..errors import PaskError
from .data import Case

MODEL_NAME = "pask-local"  # the name handed to ast_checker; function names keep their dots
_CONFIG_MODULE = "bfcl_eval.constants.model_config"


class CheckerError(PaskError):
    """bfcl-eval is missing or its checker cannot be imported."""


@dataclass(frozen=True)
class _StubModelConfig:
    underscore_to_dot: bool = False


class _StubMapping(dict):
    """Every model name maps to a config that keeps '.' in function names (our JSON allows them)."""

    def __missing__(self, key: str) -> _StubModelConfig:
        return _StubModelConfig()


@functools.cache
def _bfcl() -> tuple[Any, Any, Any]:
    """(ast_checker, Language, is_function_calling_format_output) from bfcl-eval."""
    if _CONFIG_MODULE not in sys.modules:
        stub = types.ModuleType(_CONFIG_MODULE)
        stub.__doc__ = "pask-local stand-in: the real module imports every vendor SDK."
        stub.MODEL_CONFIG_MAPPING = _StubMapping()  # type: ignore[attr-defined]
        sys.modules[_CONFIG_MODULE] = stub
    try:
        from bfcl_eval.constants.enums import Language
        from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
        from bfcl_eval.utils import is_function_calling_format_output
    except ImportError as exc:
        raise CheckerError(f"cannot import the BFCL checker ({exc}); pip install --no-deps bfcl-eval") from None
    return ast_checker, Language, is_function_calling_format_output


@dataclass(frozen=True)
class Score:
    valid: bool
    error_type: str | None
    errors: list[Any]
    decoded: list[dict[str, Any]] | None


class DecodeError(ValueError):
    """The output is not a JSON function call (or list of them)."""


def _one_call(obj: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(obj, dict):
        raise DecodeError(f"a call must be a JSON object, got {type(obj).__name__}")
    if "name" in obj:
        name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    elif len(obj) == 1:  # already in BFCL's decoded form {name: {args}}
        name, args = next(iter(obj.items()))
    else:
        raise DecodeError("a call object needs a 'name'")
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise DecodeError(f"arguments string is not JSON ({exc.msg})") from None
    if not isinstance(name, str) or not name:
        raise DecodeError("function name must be a non-empty string")
    if not isinstance(args, dict):
        raise DecodeError(f"arguments must be a JSON object, got {type(args).__name__}")
    return {name: args}


def decode_output(text: str) -> list[dict[str, dict[str, Any]]]:
    """Our JSON call output -> BFCL decoded calls ``[{name: {arg: value}}]``; DecodeError if malformed."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DecodeError(f"not JSON ({exc.msg} at char {exc.pos})") from None
    if isinstance(obj, dict) and "tool_calls" in obj:
        obj = obj["tool_calls"]
    calls = obj if isinstance(obj, list) else [obj]
    return [_one_call(c) for c in calls]


def score_decoded(case: Case, decoded: list[dict[str, Any]]) -> Score:
    """Run ast_checker on already-decoded calls."""
    if case.answer is None:
        raise CheckerError(f"case {case.id} has no possible answer to score against")
    ast_checker, language, is_format_ok = _bfcl()
    if not is_format_ok(decoded):
        return Score(False, "ast_decoder:decoder_wrong_output_format", ["wrong output format"], decoded)
    result = ast_checker(case.functions, decoded, case.answer, language.PYTHON, case.checker_category, MODEL_NAME)
    valid = bool(result.get("valid"))
    return Score(valid, None if valid else result.get("error_type", "unknown"), result.get("error", []), decoded)


def score_output(case: Case, text: str) -> Score:
    """Score a raw generated text: parse failures are invalid (error type ``ast_decoder:decoder_failed``)."""
    try:
        decoded = decode_output(text)
    except DecodeError as exc:
        return Score(False, "ast_decoder:decoder_failed", [str(exc)], None)
    return score_decoded(case, decoded)
