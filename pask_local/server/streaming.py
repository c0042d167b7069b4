"""Streaming: generated text -> OpenAI chunk deltas (content, tool-call deltas) and SSE framing.

``ReplyStreamer`` reads the model's output as it grows and yields the deltas OpenAI streams:
``{"content": ...}`` for text, and for every call first
``{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}``
once the function's name is complete, then ``{"tool_calls": [{"index", "function": {"arguments":
fragment}}]}`` as the arguments object is generated. Concatenated, the fragments are the
arguments JSON the model wrote. The text it streams equals the final reply's ``content``: the
text before the first call opener, stripped (``chat.protocol.Plan.parse``).

Two layouts, as ``chat.protocol`` plans them: a model's own protocol (``opener``, e.g.
``<tool_call>``: text, then ``opener {"name": ..., "arguments": {...}} closer`` blocks) and the
instruction protocol (no opener: the whole output is one call object, or a list of them). A format
that ``fences`` (``tagging.native``) has a second opener: a reply that *begins* with
```` ```json ```` (or a bare fence before ``{``) is fenced calls, streamed as tool-call deltas with
no content, as ``Plan.parse`` reads it; a fence after text is content.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from typing import Any

from ..chat.result import new_call_id
from ..tagging.native import fence_match, fenced_format

_WS = " \t\r\n"


class _CallScanner:
    """Reads one ``{"name": "...", "arguments": {...}}`` object a character at a time."""

    def __init__(self) -> None:
        self.depth = 0            # brace/bracket depth of the call object
        self.in_str = False
        self.esc = False
        self.buf: list[str] = []  # the current depth-1 string (a key or the name)
        self.key: str | None = None
        self.after_colon = False  # waiting for a depth-1 value
        self.name: str | None = None
        self.args: list[str] = []
        self.args_state = 0       # 0 not yet, 1 reading, 2 complete
        self.a_depth = 0
        self.a_str = False
        self.a_esc = False
        self.done = False

    def feed(self, c: str) -> None:
        if self.args_state == 1 and self._arg_char(c):
            return
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if self.depth == 1:
                    self._string_done("".join(self.buf))
                return
            if self.depth == 1:
                self.buf.append(c)
            return
        if self.after_colon and self.depth == 1 and c not in _WS:
            self.after_colon = False
            if self.key == "arguments" and self.args_state == 0:
                self.args_state = 1
                self._arg_char(c)
                return
        if c == '"':
            self.in_str = True
            self.buf = []
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.done = True
        elif c == ":" and self.depth == 1:
            self.after_colon = True
        elif c == "," and self.depth == 1:
            self.key = None

    def _string_done(self, text: str) -> None:
        if self.key is None:
            self.key = text            # a key: its value follows the colon
        elif self.key == "name" and self.name is None:
            try:
                self.name = json.loads('"' + text + '"')
            except json.JSONDecodeError:
                self.name = text

    def _arg_char(self, c: str) -> bool:
        """One character of the arguments value (an object, as the grammar writes it, or a scalar);
        False when ``c`` is not part of it (it ends a scalar and belongs to the call object)."""
        if self.a_str:
            self.args.append(c)
            if self.a_esc:
                self.a_esc = False
            elif c == "\\":
                self.a_esc = True
            elif c == '"':
                self.a_str = False
                if self.a_depth == 0:
                    self.args_state = 2
            return True
        if self.a_depth == 0 and self.args and c in ",}]" + _WS:
            self.args_state = 2
            return False
        self.args.append(c)
        if c == '"':
            self.a_str = True
        elif c in "{[":
            self.a_depth += 1
        elif c in "}]":
            self.a_depth -= 1
            if self.a_depth == 0:
                self.args_state = 2
        return True


class ReplyStreamer:
    """Turns growing output text into OpenAI deltas (module docstring).

    ``calls``: the reply may hold calls (tool_choice is not none); ``opener`` / ``closer``: the
    model's own call markers, or None for the instruction protocol (the output is call JSON);
    ``fences``: a reply that begins with a markdown fence is calls (None: as the known format
    with this opener says; only ``auto`` can produce one, the other choices force the opener).
    """

    def __init__(self, calls: bool, opener: str | None, closer: str | None = None,
                 fences: bool | None = None) -> None:
        self.calls = calls
        self.opener = opener
        self.closer = closer
        self.fence_open = calls and (fenced_format(opener) if fences is None else fences)
        self.fenced = False        # the reply is fenced calls
        self.mode = "text" if (not calls or opener is not None) else "seek"
        self.started = False       # any non-space content emitted
        self.pending = ""          # text held back (trailing space, a possible opener prefix)
        self.scanner: _CallScanner | None = None
        self.index = -1            # the current call's index
        self.announced = False     # the current call's first delta has gone out
        self.sent_args = 0         # argument characters already sent for the current call
        self.n_calls = 0
        self.ids: list[str] = []
        self.gap = ""              # text after a call, searched for the next opener
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed_bytes(self, piece: bytes) -> list[dict[str, Any]]:
        """A token's raw bytes (possibly half a UTF-8 character)."""
        return list(self._feed(self._utf8.decode(piece)))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held back once generation has ended."""
        out = list(self._feed(self._utf8.decode(b"", final=True)))
        if self.mode == "text" and self.pending.strip():
            out.append({"content": self.pending.rstrip()})
        self.pending = ""
        return out

    # ------------------------------------------------------------- internals
    def _feed(self, text: str) -> Iterator[dict[str, Any]]:
        i = 0
        while i < len(text):
            if self.mode == "text":
                i = yield from self._text(text, i)
            elif self.mode == "seek":
                i = self._seek(text, i)
            elif self.mode == "call":
                i = yield from self._call(text, i)
            else:
                i = self._between(text, i)

    def _between(self, text: str, i: int) -> int:
        """A model's own protocol after a call: text up to the next opener is not part of the reply."""
        assert self.opener is not None
        self.gap += text[i:]
        at = self.gap.find(self.opener)
        if at < 0:
            self.gap = self.gap[-(len(self.opener) - 1):] if len(self.opener) > 1 else ""
            return len(text)
        rest = self.gap[at + len(self.opener):]
        self.gap = ""
        self.mode = "call"
        self.scanner = None
        consumed = len(text) - len(rest)  # the rest is fed again from its start in ``text``
        return max(i, consumed)

    def _text(self, text: str, i: int) -> Iterator[dict[str, Any]]:
        """Content before the first call; returns the index where the rest starts."""
        self.pending += text[i:]
        if not self.started:
            self.pending = self.pending.lstrip(_WS)
        if self.fence_open:
            fence = fence_match(self.pending)
            if fence is None:
                return len(text)   # whitespace or a possible fence opener: wait
            self.fence_open = False
            if fence:
                rest, self.pending = self.pending, ""
                self.fenced = True
                self.mode = "call"  # the call scanner skips the fence line to the object's "{"
                self.scanner = None
                yield from self._feed(rest)
                return len(text)
        if self.calls and self.opener:
            at = self.pending.find(self.opener)
            if at >= 0:
                before = self.pending[:at].rstrip(_WS)
                rest = self.pending[at + len(self.opener):]
                self.pending = ""
                if before:
                    yield {"content": before}
                    self.started = True
                self.mode = "call"
                self.scanner = None
                yield from self._feed(rest)
                return len(text)
        hold = 0  # a possible start of the opener, and the space before it, wait for more text
        if self.calls and self.opener:
            for k in range(min(len(self.opener) - 1, len(self.pending)), 0, -1):
                if self.opener.startswith(self.pending[len(self.pending) - k:]):
                    hold = k
                    break
        head = self.pending[:len(self.pending) - hold]
        ready = head.rstrip(_WS)
        if ready:
            yield {"content": ready}
            self.started = True
            self.pending = self.pending[len(ready):]
        return len(text)

    def _seek(self, text: str, i: int) -> int:
        """Instruction protocol: skip to the next call object's opening brace."""
        while i < len(text):
            if text[i] == "{":
                self.mode = "call"
                self.scanner = None
                return i
            i += 1
        return i

    def _call(self, text: str, i: int) -> Iterator[dict[str, Any]]:
        if self.scanner is None:
            while i < len(text) and text[i] != "{":
                i += 1
            if i == len(text):
                return i
            self.scanner = _CallScanner()
            self.index = self.n_calls
            self.n_calls += 1
            self.announced = False
            self.sent_args = 0
        sc = self.scanner
        while i < len(text) and not sc.done:
            sc.feed(text[i])
            i += 1
        if sc.name is not None and not self.announced:
            call_id = new_call_id()
            self.ids.append(call_id)
            self.announced = True
            yield {"tool_calls": [{"index": self.index, "id": call_id, "type": "function",
                                   "function": {"name": sc.name, "arguments": ""}}]}
        if self.announced and len(sc.args) > self.sent_args:
            frag = "".join(sc.args[self.sent_args:])
            self.sent_args = len(sc.args)
            yield {"tool_calls": [{"index": self.index, "function": {"arguments": frag}}]}
        if sc.done:
            self.scanner = None
            # fenced calls: only closing and opening fences lie between them, so seek the next "{"
            self.mode = "between" if self.opener is not None and not self.fenced else "seek"
            self.gap = ""
        return i


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_KEEPALIVE = ": keep-alive\n\n"
