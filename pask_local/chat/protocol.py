"""How one request is put to the model and read back: prompt, grammar, trigger, output parser.

``plan(model, tools, messages, tool_choice, ...)`` picks the protocol by prompt ``style``:

- ``native`` (``auto`` picks it when the GGUF's chat template has a tools branch and a call
  format pask-local knows, ``tagging.native``): the template renders the conversation with its
  own ``tools`` argument; the model answers in its own format (``<tool_call>`` blocks);
- ``instruction`` (``auto`` otherwise; ``chat`` / ``plain`` force one rendering): today's
  instruction prompt (``tagging.prompt``): the answer is a bare JSON call (or list of calls).

``tool_choice`` (``messages.ToolChoice``): ``required`` and a named function constrain generation
from the first token (a named function: a grammar over that tool only; the prompt still shows all
tools); ``auto`` lets the model write text, and the call grammar engages when it writes the call
opener (``Plan.trigger``; the instruction protocol has no opener, so there ``auto`` is
``required``); ``none`` is free text with the call opener banned (``Plan.banned``).
With a format that ``fences`` (Hermes/Qwen ``<tool_call>``: Qwen2.5-Coder often writes a call as a
```` ```json ```` block instead), ``auto`` also reads a reply that *begins* with a fence opener as
calls: ``Plan.fenced`` is the grammar that engages then (``schema.gbnf.build_fenced_grammar``).
A fence after other text stays text.
Few-shot ``examples`` exist only in the instruction protocol.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import PaskError
from ..generate import parse_output, validate_calls
from ..llm import Model
from ..messages import Message, ToolChoice
from ..schema.gbnf import CallGrammar, build_fenced_grammar, build_grammar, build_native_grammar
from ..schema.tools import ToolSpec
from ..tagging.native import FENCE_CLOSE, CallFormat, call_format, fence_match, render_native
from ..tagging.prompt import Prompt, bos_text, map_spans, render_prompt
from .result import AssistantMessage

STYLES = ("auto", "native", "instruction", "chat", "plain")
# a fenced call block: the opening fence line (```json, or a bare fence before an object), the
# object (read with raw_decode, so a ``` inside a string does not end it), the closing fence
_FENCE_OPEN = re.compile(r"\s*```(?:json)?[ \t]*\n\s*(?=\{)")
_FENCE_END = re.compile(r"\s*" + re.escape(FENCE_CLOSE))


@dataclass
class Parsed:
    """A generated text read back: the reply, its calls, the call JSON as before, the first error."""

    message: AssistantMessage
    calls: list[dict[str, Any]]
    parsed: Any            # one call object, or the list of calls with ``parallel``; None for text
    error: str | None


@dataclass
class Plan:
    """Everything generation needs for one request."""

    prompt: Prompt
    tools: list[ToolSpec]
    choice: ToolChoice
    parallel: bool
    grammar: CallGrammar | None      # None: free text (tool_choice none)
    fmt: CallFormat | None           # the native call format; None: instruction protocol
    trigger: str | None = None       # auto: the grammar engages when the text contains this
    banned: tuple[str, ...] = ()     # token texts never generated (none: the call opener)
    fenced: CallGrammar | None = None  # auto, a fencing format: the grammar for a reply that starts with a fence

    def parse(self, text: str, finish: str, max_tokens: int) -> Parsed:
        if self.fmt is None:
            return self._parse_instruction(text, finish, max_tokens)
        return self._parse_native(text, finish, max_tokens)

    def _parse_instruction(self, text: str, finish: str, max_tokens: int) -> Parsed:
        if self.grammar is None:
            return Parsed(AssistantMessage(text.strip()), [], None, None)
        parsed, calls, error = parse_output(text, finish, max_tokens, self.grammar.tools, self.parallel)
        return Parsed(AssistantMessage.from_calls(calls if error is None else []), calls, parsed, error)

    def _parse_native(self, text: str, finish: str, max_tokens: int) -> Parsed:
        fmt = self.fmt
        assert fmt is not None
        if self.fenced is not None and fence_match(text):
            return self._parse_fenced(text, finish, max_tokens)
        at = text.find(fmt.trigger)
        content = (text if at < 0 else text[:at]).strip() or None
        if self.grammar is None or at < 0:
            error = "the model answered in text, not with a call" if self.choice.calls else None
            return Parsed(AssistantMessage(content), [], None, error)
        if finish == "length":
            return Parsed(AssistantMessage(content), [], None, f"the call did not finish within max_tokens={max_tokens}")
        pattern = re.escape(fmt.trigger) + r"\s*(.*?)\s*" + re.escape(fmt.close.strip())
        calls: list[Any] = []
        for body in re.findall(pattern, text[at:], flags=re.S):
            try:
                calls.append(json.loads(body))
            except json.JSONDecodeError as exc:
                return Parsed(AssistantMessage(content), [], None, f"a call is not valid JSON: {exc.msg}")
        if not calls:
            return Parsed(AssistantMessage(content), [], None, "no complete call in the output")
        return self._validated(calls, content)

    def _validated(self, calls: list[Any], content: str | None) -> Parsed:
        assert self.grammar is not None
        calls, error = validate_calls(calls, self.grammar.tools, True)
        if error is None and not self.parallel and len(calls) != 1:
            error = f"expected one call, got {len(calls)}"
        parsed = calls if self.parallel else calls[0]
        return Parsed(AssistantMessage.from_calls(calls if error is None else [], content), calls, parsed, error)

    def _parse_fenced(self, text: str, finish: str, max_tokens: int) -> Parsed:
        """A reply that begins with a fence opener: the decoder held it to fenced calls, so it is
        read as calls (content None), and a broken one is an error, as a broken ``<tool_call>`` is."""
        def failed(error: str) -> Parsed:
            return Parsed(AssistantMessage(None), [], None, error)

        if finish == "length":
            return failed(f"the call did not finish within max_tokens={max_tokens}")
        calls: list[Any] = []
        pos, decoder = 0, json.JSONDecoder()
        while (m := _FENCE_OPEN.match(text, pos)) is not None:
            try:
                call, end = decoder.raw_decode(text, m.end())
            except json.JSONDecodeError as exc:
                return failed(f"a fenced call is not valid JSON: {exc.msg}")
            close = _FENCE_END.match(text, end)
            if close is None:
                return failed(f"a fenced call is not closed by {FENCE_CLOSE}")
            calls.append(call)
            pos = close.end()
        if not calls or text[pos:].strip():
            return failed("text after the fenced calls" if calls else "no complete call in the output")
        return self._validated(calls, None)


def _grammar_tools(tools: list[ToolSpec], choice: ToolChoice) -> list[ToolSpec]:
    return [t for t in tools if t.name == choice.name] if choice.mode == "function" else tools


def resolve_style(model: Model, style: str) -> tuple[str, CallFormat | None]:
    """(rendering: native | chat | plain, the native call format or None)."""
    if style not in STYLES:
        raise PaskError(f"unknown prompt style '{style}' ({', '.join(STYLES)})")
    template = model.chat_template()
    fmt = call_format(template) if template and style in ("auto", "native") else None
    if style == "native" and fmt is None:
        raise PaskError("this model's chat template has no tool-call protocol pask-local knows "
                        "(use the instruction prompt: --prompt-style plain)")
    if fmt is not None:
        return "native", fmt
    if style in ("auto", "instruction", "native"):
        return ("chat" if template else "plain"), None
    return style, None


def plan(model: Model, tools: list[ToolSpec], messages: list[Message], choice: ToolChoice, parallel: bool = False,
         style: str = "auto", examples: list[tuple[str, str]] | None = None, max_string: int | None = None,
         max_calls: int | None = None) -> Plan:
    """Render and tag the prompt and build the grammar for one request (module docstring)."""
    rendering, fmt = resolve_style(model, style)
    gtools = _grammar_tools(tools, choice)
    if fmt is None:
        request: str | list[Message] = messages
        if len(messages) == 1 and messages[0].role == "user":
            request = messages[0].content or ""
        prompt = render_prompt(model, tools, request, examples=examples, parallel=parallel, style=rendering)
        grammar = None if choice.mode == "none" else build_grammar(gtools, parallel, max_string, max_calls)
        return Plan(prompt, tools, choice, parallel, grammar, None)
    template = model.chat_template()
    assert template is not None
    spans = render_native(template, tools, messages, bos_text=bos_text(model), strip_bos=model.add_bos)
    tokens, classes = map_spans(model, spans, special_template=True)
    prompt = Prompt(spans=spans, tokens=tokens, classes=classes, style="native")
    if choice.mode == "none":
        return Plan(prompt, tools, choice, parallel, None, fmt, banned=(fmt.trigger,))
    grammar = build_native_grammar(gtools, fmt.open, fmt.close, fmt.sep, parallel, max_string, max_calls)
    if choice.mode != "auto":
        return Plan(prompt, tools, choice, parallel, grammar, fmt)
    fenced = build_fenced_grammar(gtools, parallel, max_string, max_calls) if fmt.fences else None
    return Plan(prompt, tools, choice, parallel, grammar, fmt, trigger=fmt.trigger, fenced=fenced)
