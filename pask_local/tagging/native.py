"""The model's own tool-call protocol: detect it in a chat template, render a conversation with it.

Detection (``call_format``): the template is rendered with and without a probe tool; when the
``tools`` argument changes nothing, the template has no tools branch (None: use the instruction
prompt). Otherwise a conversation with one assistant call to the probe is rendered, and a known call
format (``KNOWN_FORMATS``: Hermes-style ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``,
as Qwen2.5 and Qwen3 use) must appear around the call's JSON, and the probe tool's definition must be
locatable (below); else None.

Rendering (``render_native``): the template runs once with sentinel strings as message contents
and the tools as OpenAI tool objects. Each sentinel is replaced by its message's text, tagged by
role (system and user text ``query``, earlier assistant text ``query``, tool output
``tool_result``); each tool's serialisation is found by re-serialising it as the template does
(``tojson``: compact, or indented by 2 or 4; with or without the ``{"type": "function"}``
envelope) and replaced by ``prompt.tool_spans`` with per-piece classes; the name of an earlier
assistant call is ``tool_name`` and its arguments' JSON ``query``. All other text is ``template``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from ..classes import StructuralClass as C
from ..errors import PaskError
from ..messages import Message
from ..schema.tools import ToolSpec, load_tools
from .prompt import Span, function_object, tool_spans
from .template import ChatTemplateError, render_template

SENTINEL = "\x00PASK{}\x00"
LAYOUTS: tuple[tuple[bool, int | None], ...] = tuple((env, ind) for env in (True, False) for ind in (None, 2, 4))


@dataclass(frozen=True)
class CallFormat:
    """How the model writes a call: ``open`` + call JSON + ``close``, calls joined by ``sep``.

    ``fences``: models of this format are known to write a call as a markdown block instead
    (```` ```json\n{"name": ..., "arguments": ...}\n``` ````, Qwen2.5-Coder's habit, which
    llama.cpp's Hermes/Qwen parser also accepts); under ``tool_choice`` auto a reply that *begins*
    with a fence opener (``FENCE_OPENERS``) is read as fenced calls (``fence_match``).
    """

    name: str
    open: str
    close: str
    sep: str
    fences: bool = False

    @property
    def trigger(self) -> str:
        """The text that opens a call (a lazy grammar engages when the model writes it)."""
        return self.open.strip()

    def block(self, call_json: str) -> str:
        return self.open + call_json + self.close


KNOWN_FORMATS: tuple[CallFormat, ...] = (CallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", fences=True),)
# A fenced call starts with one of these (after optional whitespace): "```json", or a bare fence
# whose next line opens an object. A bare "```" followed by anything else is a code block, not a call.
FENCE_OPENERS = ("```json", "```\n{")
FENCE_CLOSE = "```"
_LEAD_WS = " \t\r\n"


def fence_match(text: str) -> bool | None:
    """Whether a reply beginning ``text`` is a fenced call: True (it starts with a fence opener after
    optional whitespace), None (undecided: it is still whitespace or a proper prefix of an opener),
    False (it is not; a fence after other text never is)."""
    head = text.lstrip(_LEAD_WS)
    if any(head.startswith(o) for o in FENCE_OPENERS):
        return True
    return None if any(o.startswith(head) for o in FENCE_OPENERS) else False


def fenced_format(opener: str | None) -> bool:
    """Whether the known format whose call opener is ``opener`` accepts fenced calls."""
    return any(f.fences and f.trigger == opener for f in KNOWN_FORMATS)
_PROBE = load_tools([{"name": "pask_probe_fn", "description": "probe",
                      "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}])


def openai_tool(tool: ToolSpec) -> dict[str, Any]:
    return {"type": "function", "function": function_object(tool)}


def template_message(m: Message, content: str | None) -> dict[str, Any]:
    """A message as chat templates expect it (HF convention: call arguments as an object)."""
    out: dict[str, Any] = {"role": m.role, "content": content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _render(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            generation: bool, bos_text: str, eos_text: str) -> str:
    return render_template(template, messages=messages, tools=tools, add_generation_prompt=generation,
                           bos_token=bos_text, eos_token=eos_text)


def locate_tool(text: str, tool: ToolSpec, start: int = 0) -> tuple[int, list[Span]] | None:
    """(offset, tagged spans) of ``tool``'s serialisation in ``text`` at or after ``start``."""
    for env, ind in LAYOUTS:
        spans = tool_spans(tool, ind, env)
        at = text.find("".join(s for s, _ in spans), start)
        if at >= 0:
            return at, spans
    return None


@functools.lru_cache(maxsize=16)
def call_format(template: str) -> CallFormat | None:
    """The template's native call format, or None (no tools branch, or a format we do not know)."""
    user = {"role": "user", "content": "hi"}
    probe = [openai_tool(t) for t in _PROBE]
    try:
        bare = _render(template, [user], None, True, "", "")
        with_tools = _render(template, [user], probe, True, "", "")
        if bare == with_tools or locate_tool(with_tools, _PROBE[0]) is None:
            return None
        call = {"id": "call_0", "type": "function", "function": {"name": "pask_probe_fn", "arguments": {"x": 1}}}
        conv = _render(template, [user, {"role": "assistant", "content": None, "tool_calls": [call]}], probe,
                       False, "", "")
    except ChatTemplateError:
        return None
    call_json = json.dumps({"name": "pask_probe_fn", "arguments": {"x": 1}})
    return next((f for f in KNOWN_FORMATS if f.block(call_json) in conv), None)


def _content_class(role: str) -> C:
    return C.TOOL_RESULT if role == "tool" else C.QUERY


def render_native(template: str, tools: list[ToolSpec], messages: list[Message], bos_text: str = "",
                  eos_text: str = "", strip_bos: bool = False) -> list[Span]:
    """The conversation rendered by the model's template with its tools, as class-tagged spans."""
    sentinels = {i: SENTINEL.format(i) for i, m in enumerate(messages) if m.content}
    dicts = [template_message(m, sentinels.get(i, m.content)) for i, m in enumerate(messages)]
    text = _render(template, dicts, [openai_tool(t) for t in tools], True, bos_text, eos_text)
    if strip_bos and bos_text and text.startswith(bos_text):
        text = text[len(bos_text):]  # BOS is added as a token
    marks: list[tuple[int, int, list[Span]]] = []
    msg_end: dict[int, int] = {}
    for i, s in sentinels.items():
        if text.count(s) != 1:
            raise PaskError(f"the model's chat template does not show messages[{i}] ({messages[i].role}) exactly once")
        at = text.index(s)
        marks.append((at, at + len(s), [(messages[i].content or "", _content_class(messages[i].role))]))
        msg_end[i] = at + len(s)
    taken = sorted((a, b) for a, b, _ in marks)

    def free(a: int, b: int) -> bool:
        return all(b <= x or a >= y for x, y in taken)

    for tool in tools:
        start = 0
        while (found := locate_tool(text, tool, start)) is not None:
            at, spans = found
            end = at + sum(len(s) for s, _ in spans)
            if free(at, end):
                break
            start = at + 1
        if found is None:
            raise PaskError(f"cannot find tool '{tool.name}' in the chat template's rendering")
        marks.append((at, end, spans))
        taken.append((at, end))
    cursor = 0
    for i, m in enumerate(messages):
        cursor = msg_end.get(i, cursor)
        for call in m.tool_calls:
            for needle, cls in ((call.name, C.TOOL_NAME), (json.dumps(call.arguments, ensure_ascii=False), C.QUERY)):
                at = text.find(needle, cursor)
                while at >= 0 and not free(at, at + len(needle)):
                    at = text.find(needle, at + 1)
                if at >= 0:
                    marks.append((at, at + len(needle), [(needle, cls)]))
                    taken.append((at, at + len(needle)))
                    cursor = at + len(needle)
    out: list[Span] = []
    pos = 0
    for a, b, spans in sorted(marks, key=lambda m: m[0]):
        out.append((text[pos:a], C.TEMPLATE))
        out += spans
        pos = b
    out.append((text[pos:], C.TEMPLATE))
    return [s for s in out if s[0]]
