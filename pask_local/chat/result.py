"""The assistant's reply in OpenAI's shape: ``content`` and/or ``tool_calls`` with ``call_...`` ids."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from ..messages import ToolCall


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class AssistantMessage:
    """What the model answered: text (``content``), calls, or both."""

    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def from_calls(cls, calls: list[dict[str, Any]], content: str | None = None) -> AssistantMessage:
        """From parsed ``{"name", "arguments"}`` calls; each gets a fresh id."""
        return cls(content, [ToolCall(new_call_id(), c["name"], c["arguments"]) for c in calls])

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else "stop"

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return out
