"""Renders a model's chat template (untrusted code from a GGUF file) in jinja2's immutable sandbox.

A chat template comes with the model file, and model files come from anyone (``hf://``, a user's
disk): it is code. Every template in pask-local is rendered here, in
``jinja2.sandbox.ImmutableSandboxedEnvironment``, which refuses attribute walks to Python internals
(``__globals__``, ``__subclasses__``, ``__init__`` ...) and every mutation of the objects passed in.
The helpers Hugging Face templates expect are provided: ``raise_exception``, ``strftime_now`` and
a ``tojson`` filter with HF's defaults (no ASCII escaping, ``indent`` as a keyword). Anything a
template does wrong, including what the sandbox refuses, becomes one ``PaskError`` line.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

from ..errors import PaskError


class ChatTemplateError(PaskError):
    """A chat template failed to parse or render, raised an error, or touched something unsafe."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's tojson: json.dumps without HTML escaping (jinja's own filter escapes < > & ')
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment():
    import jinja2
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class StrictSandbox(ImmutableSandboxedEnvironment):
        """Refuses an unsafe attribute at once (the stock sandbox returns an undefined that a
        chainable undefined would silently print as empty)."""

        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    return StrictSandbox(undefined=jinja2.ChainableUndefined, trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols"], autoescape=False)


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    import jinja2

    env = _environment()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"cannot parse the model's chat template: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] if text else type(exc).__name__


def render_template(template: str, **context: Any) -> str:
    """Render ``template`` in the sandbox with ``context``; every failure is a ChatTemplateError."""
    from jinja2.exceptions import SecurityError, TemplateError

    compiled = _compiled(template)
    try:
        return compiled.render(**context)
    except ChatTemplateError:
        raise
    except SecurityError as exc:
        raise ChatTemplateError(f"the model's chat template tried an unsafe operation, refused: {_one_line(exc)}"
                                ) from None
    except TemplateError as exc:
        raise ChatTemplateError(f"cannot render the model's chat template: {_one_line(exc)}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
            RecursionError, MemoryError) as exc:
        raise ChatTemplateError(f"the model's chat template failed: {type(exc).__name__}: {_one_line(exc)}"
                                ) from None
