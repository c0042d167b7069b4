"""Tags generated tokens of a function call from the grammar parser state plus the emitted text.

The tagger advances the grammar itself, one byte at a time (through single-byte tokens; the
grammar treats them exactly like the bytes of the sampled token), and before each byte reads the
active stacks. The innermost stack frame whose rule has a ``Role`` (``schema.gbnf``: tool name,
property key, value at a path) says what the byte belongs to; generated sub-rules ``<rule>_<n>``
inherit the role, and the gbnf builder never references a shared rule in tail position from a
value, so the role frame is on the stack even though the grammar engine drops tail-position rules.
The emitted text decides the byte's kind: whitespace outside strings -> ``gen_ws``, JSON syntax
(braces, brackets, commas, colons, quotes) -> ``gen_struct``, content -> the role's class
(``gen_name``, ``gen_key``, ``gen_value_required`` / ``gen_value_optional``; content without a role,
i.e. the envelope keys "name"/"arguments", -> ``gen_struct``). A token takes the most protective
class of its bytes; when stacks disagree (e.g. several optional keys share a prefix) the most
protective candidate wins.
"""

from __future__ import annotations

from .._byte_tokens import byte_tokens
from ..classes import StructuralClass as C
from ..classes import more_protective
from ..grammar.state import GrammarState
from ..llm import Model
from ..schema.gbnf import CallGrammar, Role

WS = frozenset(b" \t\n\r")
PUNCT = frozenset(b"{}[],:")


def role_class(role: Role | None) -> C:
    if role is None:
        return C.GEN_STRUCT
    if role.kind == "name":
        return C.GEN_NAME
    if role.kind == "key":
        return C.GEN_KEY
    return C.GEN_VALUE_REQUIRED if role.required else C.GEN_VALUE_OPTIONAL


class _Lexer:
    """Byte-level JSON lexer: kind of each emitted byte ("ws", "punct" or "content")."""

    def __init__(self) -> None:
        self.in_string = False
        self.escape = False

    def kind(self, b: int) -> str:
        if self.in_string:
            if self.escape:
                self.escape = False
                return "content"
            if b == 0x5C:  # backslash
                self.escape = True
                return "content"
            if b == 0x22:
                self.in_string = False
                return "punct"
            return "content"
        if b == 0x22:
            self.in_string = True
            return "punct"
        if b in PUNCT:
            return "punct"
        if b in WS:
            return "ws"
        return "content"  # numbers, true/false/null


class CallTagger:
    """Accepts sampled tokens into ``state`` byte by byte and returns each token's class."""

    def __init__(self, model: Model, grammar: CallGrammar, state: GrammarState) -> None:
        self.model = model
        self.state = state
        self.rule_role: list[Role | None] = [grammar.role_of(n) for n in state.rule_names]
        self.byte_tok = byte_tokens(model)
        self.lexer = _Lexer()
        self.roles: list[list[Role | None]] = []  # per generated token: the content roles seen

    def _current_class(self) -> C:
        best: C | None = None
        for stack in self.state.stacks():
            role = None
            for rule in stack:
                role = self.rule_role[rule]
                if role is not None:
                    break
            cls = role_class(role)
            best = cls if best is None else more_protective(best, cls)
        return best if best is not None else C.GEN_STRUCT

    def accept(self, token: int, piece: bytes) -> C:
        """Accept ``token`` (whose bytes are ``piece``) into the grammar; its structural class."""
        if any(self.byte_tok[b] < 0 for b in piece) and max(piece) >= 0x80:
            self.byte_tok = byte_tokens(self.model, full=True)
        if not piece or any(self.byte_tok[b] < 0 for b in piece):
            # no single-byte route: accept the token whole and tag it from the text alone
            self.state.accept(token)
            kinds = [self.lexer.kind(b) for b in piece]
            return C.GEN_STRUCT if "punct" in kinds or "content" in kinds or not kinds else C.GEN_WS
        cls: C | None = None
        for b in piece:
            kind = self.lexer.kind(b)
            if kind == "content":
                c = self._current_class()
            else:
                c = C.GEN_WS if kind == "ws" else C.GEN_STRUCT
            self.state.accept(self.byte_tok[b])
            cls = c if cls is None else more_protective(cls, c)
        assert cls is not None
        return cls
