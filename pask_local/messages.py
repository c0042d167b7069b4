"""OpenAI-style chat messages and ``tool_choice``, parsed and validated into typed values.

Roles: ``system``, ``user``, ``assistant`` (``content`` and/or ``tool_calls``; each call
``{"id", "type": "function", "function": {"name", "arguments"}}`` with ``arguments`` a JSON string
as OpenAI sends it, or an object) and ``tool`` (``content`` plus ``tool_call_id`` naming a call an
earlier assistant message made). ``content`` may be a string or a list of ``{"type": "text",
"text": ...}`` parts. Every problem is one ``MessageError`` line naming the message index.
``tool_choice``: ``auto``, ``required``, ``none`` or ``{"type": "function", "function": {"name"}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .errors import PaskError

ROLES = ("system", "user", "assistant", "tool")
CHOICES = ("auto", "required", "none")


class MessageError(PaskError):
    """A message list or tool_choice is malformed."""


@dataclass(frozen=True)
class ToolCall:
    """One function call: its id, the function's name and its arguments (parsed)."""

    id: str
    name: str
    arguments: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass(frozen=True)
class Message:
    """One message of a conversation."""

    role: str
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


def user_message(text: str) -> list[Message]:
    """A conversation of one user message."""
    return [Message("user", text)]


def _content(raw: Any, where: str, optional: bool) -> str | None:
    if raw is None and optional:
        return None
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and raw and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in raw):
        return "".join(p["text"] for p in raw)
    raise MessageError(f"{where}: 'content' must be a string (or a list of {{\"type\": \"text\", \"text\": ...}} "
                       f"parts), got {type(raw).__name__}")


def _tool_call(raw: Any, where: str) -> ToolCall:
    if not isinstance(raw, dict):
        raise MessageError(f"{where}: a tool call must be an object, got {type(raw).__name__}")
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise MessageError(f"{where}: a tool call needs a 'function' object")
    if raw.get("type", "function") != "function":
        raise MessageError(f"{where}: tool call type must be 'function', got {raw.get('type')!r}")
    call_id, name, args = raw.get("id"), fn.get("name"), fn.get("arguments", "{}")
    if not isinstance(call_id, str) or not call_id:
        raise MessageError(f"{where}: a tool call needs a non-empty string 'id'")
    if not isinstance(name, str) or not name:
        raise MessageError(f"{where}: a tool call needs a function 'name' (string)")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise MessageError(f"{where}: 'arguments' of '{name}' is not valid JSON ({exc.msg})") from None
    if not isinstance(args, dict):
        raise MessageError(f"{where}: 'arguments' of '{name}' must be a JSON object")
    return ToolCall(call_id, name, args)


def parse_messages(data: Any) -> list[Message]:
    """Validate an OpenAI-style message list (``data``: parsed JSON) into ``Message``s."""
    if not isinstance(data, list) or not data:
        raise MessageError("messages must be a non-empty JSON list of message objects")
    out: list[Message] = []
    call_ids: set[str] = set()
    for i, raw in enumerate(data):
        where = f"messages[{i}]"
        if not isinstance(raw, dict):
            raise MessageError(f"{where}: a message must be an object, got {type(raw).__name__}")
        role = raw.get("role")
        if role not in ROLES:
            raise MessageError(f"{where}: unknown role {role!r} (system, user, assistant, tool)")
        if role == "assistant":
            content = _content(raw.get("content"), where, optional=True)
            calls_raw = raw.get("tool_calls") or []
            if not isinstance(calls_raw, list):
                raise MessageError(f"{where}: 'tool_calls' must be a list")
            calls = tuple(_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls_raw))
            if content is None and not calls:
                raise MessageError(f"{where}: an assistant message needs 'content' or 'tool_calls'")
            for c in calls:
                if c.id in call_ids:
                    raise MessageError(f"{where}: duplicate tool call id {c.id!r}")
                call_ids.add(c.id)
            out.append(Message(role, content, calls))
        elif role == "tool":
            ref = raw.get("tool_call_id")
            if not isinstance(ref, str) or not ref:
                raise MessageError(f"{where}: a tool result needs a string 'tool_call_id'")
            if ref not in call_ids:
                raise MessageError(f"{where}: tool result references call id {ref!r}, which no earlier assistant "
                                   "message made")
            out.append(Message(role, _content(raw.get("content"), where, optional=False), tool_call_id=ref))
        else:
            if raw.get("tool_calls"):
                raise MessageError(f"{where}: only assistant messages carry 'tool_calls'")
            out.append(Message(role, _content(raw.get("content"), where, optional=False)))
    if out[-1].role == "assistant":
        raise MessageError(f"messages[{len(out) - 1}]: the last message is the assistant's; nothing to answer")
    return out


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: auto | required | none | function (then ``name`` is the one function allowed)."""

    mode: str
    name: str | None = None

    @property
    def calls(self) -> bool:
        """Generation must produce a call."""
        return self.mode in ("required", "function")


def parse_tool_choice(raw: Any, tool_names: list[str]) -> ToolChoice:
    """``raw``: a mode string, a JSON string of the function form, or the parsed function form."""
    if isinstance(raw, ToolChoice):
        choice = raw
    elif isinstance(raw, str) and raw in CHOICES:
        choice = ToolChoice(raw)
    elif isinstance(raw, str) and raw.lstrip().startswith("{"):
        try:
            return parse_tool_choice(json.loads(raw), tool_names)
        except json.JSONDecodeError as exc:
            raise MessageError(f"tool_choice is not valid JSON ({exc.msg})") from None
    elif isinstance(raw, dict):
        fn = raw.get("function")
        if raw.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MessageError('tool_choice object must be {"type": "function", "function": {"name": ...}}')
        choice = ToolChoice("function", fn["name"])
    else:
        raise MessageError(f"tool_choice must be auto, required, none or a function object, got {raw!r}")
    if choice.mode == "function" and choice.name not in tool_names:
        raise MessageError(f"tool_choice names function {choice.name!r}, which is not among the tools "
                           f"({', '.join(tool_names)})")
    return choice
