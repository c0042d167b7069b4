"""Renders the function-calling prompt as class-tagged spans and maps the spans to token positions.

Two renderers: ``plain`` (base models such as the default Gemma 3 270M: fixed instructions, the
tool list as JSON lines, optional few-shot examples given by the caller, the user query, then the
call prefix) and ``chat`` (the GGUF's chat template rendered in jinja2's sandbox, ``template.py``; text the template adds is
``template``). Tool definitions are serialised by ``tool_spans`` with per-piece classes (tool
names, parameter names, required parameter names, types/enums/defaults/formats, descriptions,
JSON punctuation and schema keywords).

Token positions: the prompt text is tokenised as a whole (BOS first, when the GGUF asks for one); each token's byte range is
recovered by concatenating the detokenised pieces, which must reproduce the text (checked; when a
tokenizer does not, the prompt tokens are defined as the concatenation of the spans tokenised one
by one). A token overlapping several spans takes the most protective class
(``classes.more_protective``). The BOS token (or the first token without BOS) is ``sink``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..classes import StructuralClass as C
from ..classes import more_protective
from ..errors import PaskError
from ..llm import Model
from ..messages import Message
from ..schema.tools import ToolSpec
from .template import render_template

Span = tuple[str, C]
INSTRUCTIONS = ("You are a function-calling assistant. Answer the user's request with one JSON call "
                '{"name": <tool name>, "arguments": <object>} to one of the tools below. '
                "Use only the parameters a tool defines.")
INSTRUCTIONS_PARALLEL = ("You are a function-calling assistant. Answer the user's request with a JSON list of "
                         'calls [{"name": <tool name>, "arguments": <object>}, ...] to the tools below, one per '
                         "action the user asks for. Use only the parameters a tool defines.")
TYPE_KEYS = {"type", "enum", "default", "format", "minItems", "maxItems", "additionalProperties"}


@dataclass
class Prompt:
    """A rendered prompt: its text spans, token ids and one class per token."""

    spans: list[Span]
    tokens: list[int] = field(default_factory=list)
    classes: list[C] = field(default_factory=list)
    style: str = "plain"

    @property
    def text(self) -> str:
        return "".join(s for s, _ in self.spans)


def _json_spans(value: Any, ctx: tuple[str, ...], req: frozenset[str], indent: int | None = None,
                level: int = 0, root: tuple[str, ...] = ()) -> list[Span]:
    """Serialise exactly like ``json.dumps(value, ensure_ascii=False, indent=indent)``, tagging each
    piece by its schema role.

    ``req``: the ``required`` list of the nearest enclosing schema object (for its property names).
    ``root``: the path of the function object ({name, description, parameters}) inside ``value``;
    pieces outside it (an envelope such as ``{"type": "function", "function": ...}``) are punctuation.
    """
    P = C.SCHEMA_PUNCT
    item_sep = ", " if indent is None else ","

    def nl(depth: int) -> str:
        return "" if indent is None else "\n" + " " * (indent * depth)

    out: list[Span] = []
    if isinstance(value, dict) and value:
        own = value.get("required") if "properties" in value else None
        sub_req = frozenset(own) if isinstance(own, list) else req
        out.append(("{" + nl(level + 1), P))
        for i, (k, v) in enumerate(value.items()):
            if i:
                out.append((item_sep + nl(level + 1), P))
            out.append((json.dumps(k, ensure_ascii=False), _key_class(_rel(ctx, root), k, req)))
            out.append((": ", P))
            out += _json_spans(v, (*ctx, k), sub_req, indent, level + 1, root)
        out.append((nl(level) + "}", P))
    elif isinstance(value, list) and value:
        out.append(("[" + nl(level + 1), P))
        for i, v in enumerate(value):
            if i:
                out.append((item_sep + nl(level + 1), P))
            out += _json_spans(v, (*ctx, "[]"), req, indent, level + 1, root)
        out.append((nl(level) + "]", P))
    elif isinstance(value, dict | list):
        out.append(("{}" if isinstance(value, dict) else "[]", P))
    else:
        rel = _rel(ctx, root)
        out.append((json.dumps(value, ensure_ascii=False), P if rel is None else _scalar_class(rel, value)))
    return out


def _rel(ctx: tuple[str, ...], root: tuple[str, ...]) -> tuple[str, ...] | None:
    """``ctx`` relative to ``root``, or None when ``ctx`` lies outside it."""
    return ctx[len(root):] if ctx[:len(root)] == root else None


def _scalar_class(ctx: tuple[str, ...], value: Any) -> C:
    key = ctx[-1] if ctx else ""
    parent = ctx[-2] if len(ctx) > 1 else ""
    if key == "name" and len(ctx) == 1:
        return C.TOOL_NAME
    if key == "[]" and parent == "required":
        return C.PARAM_REQUIRED
    if key in TYPE_KEYS or (key == "[]" and parent == "enum"):
        return C.PARAM_TYPE
    return C.DESCRIPTION


def _key_class(ctx: tuple[str, ...] | None, key: str, req: frozenset[str]) -> C:
    if ctx and ctx[-1] == "properties":
        return C.PARAM_REQUIRED if key in req else C.PARAM_NAME
    return C.SCHEMA_PUNCT  # schema keywords and envelope keys


def _split_quotes(spans: list[Span]) -> list[Span]:
    """Quotes around names/values are JSON syntax: give them schema_punct."""
    out: list[Span] = []
    for text, cls in spans:
        if cls != C.SCHEMA_PUNCT and len(text) >= 2 and text[0] == '"' and text[-1] == '"':
            out += [('"', C.SCHEMA_PUNCT), (text[1:-1], cls), ('"', C.SCHEMA_PUNCT)]
        else:
            out.append((text, cls))
    return out


def function_object(tool: ToolSpec) -> dict[str, Any]:
    """The tool as a function object {name, description, parameters} (no description when empty)."""
    obj = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    if not tool.description:
        del obj["description"]
    return obj


def tool_spans(tool: ToolSpec, indent: int | None = None, envelope: bool = False) -> list[Span]:
    """One tool definition as JSON with classes: compact by default (``json.dumps`` separators),
    ``indent`` as ``json.dumps(indent=...)``; ``envelope``: inside ``{"type": "function", "function": ...}``."""
    obj: dict[str, Any] = function_object(tool)
    root: tuple[str, ...] = ()
    if envelope:
        obj, root = {"type": "function", "function": obj}, ("function",)
    return _split_quotes(_json_spans(obj, (), frozenset(), indent, 0, root))


def conversation_spans(messages: list[Message]) -> list[Span]:
    """A conversation for the instruction prompt: one user message is the query as it is; several
    messages are ``role: text`` lines (earlier calls as JSON, tool output tagged ``tool_result``)."""
    if len(messages) == 1 and messages[0].role == "user":
        return [(messages[0].content or "", C.QUERY)]
    T = C.TEMPLATE
    out: list[Span] = []
    for i, m in enumerate(messages):
        label = f"tool result ({m.tool_call_id})" if m.role == "tool" else m.role
        out.append((("\n" if i else "") + label + ": ", T))
        if m.content:
            out.append((m.content, C.TOOL_RESULT if m.role == "tool" else C.QUERY))
        for call in m.tool_calls:
            out += [(' {"name": "', T), (call.name, C.TOOL_NAME), ('", "arguments": ', T),
                    (json.dumps(call.arguments, ensure_ascii=False), C.QUERY), ("}", T)]
    return out


def _user_spans(request: str | list[Span]) -> list[Span]:
    return [(request, C.QUERY)] if isinstance(request, str) else list(request)


def _body_spans(tools: list[ToolSpec], request: str | list[Span], examples: list[tuple[str, str]] | None,
                parallel: bool) -> tuple[list[Span], list[Span]]:
    """(system spans, user spans)."""
    T = C.TEMPLATE
    system: list[Span] = [(INSTRUCTIONS_PARALLEL if parallel else INSTRUCTIONS, T), ("\n\nTools:\n", T)]
    for t in tools:
        system += tool_spans(t)
        system.append(("\n", T))
    if examples:
        system.append(("\nExamples:\n", T))
        for q, call in examples:
            system += [("User: ", T), (q, C.EXAMPLE), ("\nCall: ", T), (call, C.EXAMPLE), ("\n", T)]
    return system, _user_spans(request)


def render_plain(tools: list[ToolSpec], request: str | list[Span], examples: list[tuple[str, str]] | None = None,
                 parallel: bool = False) -> list[Span]:
    """The instruction prompt without a chat template; ``request``: text or tagged spans."""
    system, user = _body_spans(tools, request, examples, parallel)
    return [*system, ("\nUser: ", C.TEMPLATE), *user, ("\nCall: ", C.TEMPLATE)]


def render_chat(template: str, tools: list[ToolSpec], request: str | list[Span],
                examples: list[tuple[str, str]] | None = None, parallel: bool = False, bos_text: str = "",
                eos_text: str = "", strip_bos: bool = True) -> list[Span]:
    """The instruction prompt inside the chat template: renders it around sentinel strings, then
    splices the tagged spans in (``strip_bos``: the template's BOS text is dropped, BOS being added
    as a token)."""
    system, user = _body_spans(tools, request, examples, parallel)
    s_sys, s_user = "\x00PASK_SYSTEM\x00", "\x00PASK_USER\x00"
    text = render_template(template, messages=[{"role": "system", "content": s_sys},
                                               {"role": "user", "content": s_user}],
                           add_generation_prompt=True, bos_token=bos_text, eos_token=eos_text, tools=None)
    if text.count(s_sys) != 1 or text.count(s_user) != 1:
        raise PaskError("the model's chat template does not place system and user messages once each")
    if strip_bos and bos_text and text.startswith(bos_text):
        text = text[len(bos_text):]
    a, rest = text.split(s_sys)
    b, c = rest.split(s_user)
    out: list[Span] = [(a, C.TEMPLATE), *system, (b, C.TEMPLATE), *user, (c, C.TEMPLATE)]
    return [s for s in out if s[0]]


def map_spans(model: Model, spans: list[Span], add_bos: bool | None = None,
              special_template: bool = False) -> tuple[list[int], list[C]]:
    """Token ids of the whole prompt and one class per token (see module docstring).

    ``add_bos``: None follows the GGUF (``Model.add_bos``: Qwen2.5 says no BOS).

    ``special_template``: template spans are tokenised on their own with special-token parsing, so
    a chat template's control tokens (``<|im_start|>``, ``<start_of_turn>``) become the control
    tokens the model was trained on; every other span (tools, examples, the user's text) is
    tokenised without it, so text in a request can never forge a control token.
    """
    spans = [s for s in spans if s[0]]
    for text, cls in spans:
        _check_utf8(text, cls)
    if special_template:
        tokens, classes, group = [], [], []
        for span in [*spans, None]:
            if span is not None and span[1] is not C.TEMPLATE:
                group.append(span)
                continue
            if group:
                t, c = _aligned(model, group)
                tokens += t
                classes += c
                group = []
            if span is not None:
                ids = model.tokenize(span[0], add_special=False, parse_special=True)
                tokens += ids
                classes += [C.TEMPLATE] * len(ids)
    else:
        tokens, classes = _aligned(model, spans)
    if add_bos is None:
        add_bos = model.add_bos
    if add_bos and model.bos >= 0:
        tokens = [model.bos, *tokens]
        classes = [C.SINK, *classes]
    elif classes:
        classes[0] = C.SINK
    return tokens, classes


def _check_utf8(text: str, cls: C) -> None:
    """Text must encode as UTF-8 (a lone surrogate, e.g. an undecodable byte of argv, does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PaskError(f"prompt text ({cls.value}) is not valid UTF-8 at character {exc.start} "
                        "(an undecodable byte or a lone surrogate)") from None


def _aligned(model: Model, spans: list[Span]) -> tuple[list[int], list[C]]:
    """The spans' text tokenised as a whole, each token taking its span's class (module docstring)."""
    text = "".join(s for s, _ in spans)
    tokens = model.tokenize(text, add_special=False, parse_special=False)
    pieces = [model.piece(t) for t in tokens]
    classes: list[C]
    if b"".join(pieces) == text.encode("utf-8"):
        bounds, pos = [], 0
        for s, _ in spans:
            n = len(s.encode("utf-8"))
            bounds.append((pos, pos + n))
            pos += n
        classes, start, j = [], 0, 0
        for p in pieces:
            end = start + len(p)
            while bounds[j][1] <= start:
                j += 1
            cls, k = spans[j][1], j
            while k < len(spans) and bounds[k][0] < end:
                cls = more_protective(cls, spans[k][1]) if bounds[k][1] > start else cls
                k += 1
            classes.append(cls)
            start = end
    else:  # tokenizer inserts/merges text: the prompt is the concatenation of span tokenisations
        tokens, classes = [], []
        for s, cls in spans:
            ids = model.tokenize(s, add_special=False, parse_special=False)
            tokens += ids
            classes += [cls] * len(ids)
    return tokens, classes


def bos_text(model: Model) -> str:
    return model.piece(model.bos).decode("utf-8", "replace") if model.bos >= 0 else ""


def render_prompt(model: Model, tools: list[ToolSpec], request: str | list[Message],
                  examples: list[tuple[str, str]] | None = None, parallel: bool = False,
                  style: str = "auto") -> Prompt:
    """Render (``style``: auto | plain | chat) and tag the instruction prompt for ``model``.

    ``request``: the user's text, or a conversation (``conversation_spans``).
    """
    if isinstance(request, str):
        if not request.strip():
            raise PaskError("the request is empty")
        user: str | list[Span] = request
    else:
        user = conversation_spans(request)
    template = model.chat_template()
    if style == "auto":
        style = "chat" if template else "plain"
    if style == "chat":
        if not template:
            raise PaskError("this model has no chat template; use the plain prompt style")
        spans = render_chat(template, tools, user, examples, parallel, bos_text=bos_text(model),
                            strip_bos=model.add_bos)
    elif style == "plain":
        spans = render_plain(tools, user, examples, parallel)
    else:
        raise PaskError(f"unknown prompt style '{style}' (auto, plain, chat)")
    tokens, classes = map_spans(model, spans, special_template=style == "chat")
    return Prompt(spans=spans, tokens=tokens, classes=classes, style=style)
