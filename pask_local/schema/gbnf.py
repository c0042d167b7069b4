r"""GBNF grammars for function calls, with rule names that map parser states back to schema paths.

``build_grammar(tools, parallel)`` returns a ``CallGrammar``: the GBNF text for one call
``{"name": "<tool>", "arguments": {...}}`` (or, with ``parallel``, a JSON list of such calls) and a
table from rule name to ``Role``. Output is compact and deterministic: separators are ``", "`` and
``": "`` (Python ``json.dumps`` style), required properties come first (schema order), then the
optional ones (schema order, each may be omitted). ``build_native_grammar`` wraps the same call in a
model's own protocol (``<tool_call>`` blocks, one or more for parallel calls).

Rule names (``[a-zA-Z0-9-]``) encode tool, path and role: ``t<i>-name`` (the tool's name string),
``t<i>-k-<path>`` (a property key), ``t<i>-v-<path>`` (a value; ``-x`` marks array items, ``-a``
helpers of a free-form value). Every leaf value is written inside its own rule, never through a
shared rule in tail position, so while the parser is inside a value the value's rule (or a rule the
GBNF parser generated from it, named ``<rule>_<n>``) is on the stack.
GBNF string literals are escaped here (``lit``): llama-cpp-python's ``SchemaConverter._format_literal``
leaves backslashes alone, so a JSON escape such as ``\u001f`` or ``\\`` inside a key or an enum
string turned into a raw control character or a different escape in the output (found by fuzzing).
Numbers keep exponents to two digits (``1e999`` parses to ``inf``, which is not JSON) and ``\u``
escapes exclude the UTF-16 surrogates (a lone ``\ud800`` is not text any encoder accepts).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .tools import ToolSpec

_HEX = "[0-9a-fA-F]"
# \u escapes: any code point but the UTF-16 surrogates D800-DFFF
_U_ESCAPE = f'"u" ([0-9a-cA-CeEfF] {_HEX} {_HEX} {_HEX} | [dD] [0-7] {_HEX} {_HEX})'
CHAR_RULE = r'char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | ' + _U_ESCAPE + ")"
INT_BODY = '"-"? ("0" | [1-9] [0-9]{0,15})'
NUM_BODY = INT_BODY + ' ("." [0-9]{1,15})? ([eE] [-+]? [0-9]{1,2})?'
STR_BODY = '"\\"" char* "\\""'
PRIMITIVE_BODY = {"string": STR_BODY, "integer": INT_BODY, "number": NUM_BODY,
                  "boolean": '("true" | "false")', "null": '"null"'}
SUFFIX_RE = re.compile(r"(_\d+)+$")


_LIT_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def lit(text: str) -> str:
    """A GBNF literal matching ``text`` exactly (backslash, quote and control characters escaped)."""
    out = []
    for c in text:
        esc = _LIT_ESCAPES.get(c)
        if esc is None and (ord(c) < 0x20 or ord(c) == 0x7F):
            esc = f"\\x{ord(c):02X}"
        out.append(esc or c)
    return '"' + "".join(out) + '"'


def _jtext(value: object) -> str:
    """A JSON scalar as the model writes it: compact, non-ASCII characters raw (control ones escaped)."""
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class Role:
    """What the parser is producing inside a rule: a tool name, a property key, or a value."""

    kind: str                 # "name" | "key" | "value"
    tool: int                 # index into the tool list
    path: tuple[str, ...]     # property path inside "arguments" ("[]" marks array items)
    required: bool            # the property and all its ancestors are required


@dataclass
class CallGrammar:
    """The GBNF text of a function-call grammar and the role of each named rule."""

    text: str
    tools: list[ToolSpec]
    parallel: bool
    roles: dict[str, Role] = field(default_factory=dict)
    root: str = "root"

    def role_of(self, rule_name: str) -> Role | None:
        """The role of a rule, including rules the GBNF parser generated from it (``<rule>_<n>``)."""
        role = self.roles.get(rule_name)
        if role is None:
            role = self.roles.get(SUFFIX_RE.sub("", rule_name))
        return role


class _Builder:
    def __init__(self, tools: list[ToolSpec], max_string: int | None = None) -> None:
        self.tools = tools
        self.str_body = STR_BODY if max_string is None else f'"\\"" char{{0,{max_string}}} "\\""'
        self.prim = {**PRIMITIVE_BODY, "string": self.str_body}
        self.rules: dict[str, str] = {}
        self.roles: dict[str, Role] = {}

    def add(self, name: str, body: str, role: Role | None = None) -> str:
        base, n = name, 2
        while name in self.rules:
            name, n = f"{base}-{n}", n + 1
        self.rules[name] = body
        if role is not None:
            self.roles[name] = role
        return name

    @staticmethod
    def slug(text: str) -> str:
        s = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")
        return s[:40] or "p"

    def value(self, schema: dict[str, Any], tool: int, path: tuple[str, ...], required: bool) -> str:
        """The rule for a value at ``path``; returns the rule name."""
        name = f"t{tool}-v-" + "-".join(self.slug(p) if p != "[]" else "x" for p in path) if path else f"t{tool}-args"
        role = Role("value", tool, path, required)
        if "enum" in schema:
            return self.add(name, " | ".join(lit(_jtext(v)) for v in schema["enum"]), role)
        t = schema.get("type")
        if t is None:
            return self.any_value(name, role)
        if isinstance(t, list):
            return self.add(name, " | ".join(f"({self.prim[x]})" for x in t), role)
        if t == "object":
            if not schema.get("properties") and schema.get("additionalProperties", True) is not False:
                return self.any_value(name, role, only="object")
            return self.add(name, self.object_body(schema, tool, path, required), role)
        if t == "array":
            # items first: the rule for the array itself is added after its item rule
            item = self.value(schema.get("items", {}), tool, (*path, "[]"), required)
            return self.add(name, self.array_body(item, schema.get("minItems", 0), schema.get("maxItems")), role)
        return self.add(name, self.prim[t], role)

    def object_body(self, schema: dict[str, Any], tool: int, path: tuple[str, ...], required: bool) -> str:
        props: dict[str, Any] = schema.get("properties", {})
        req = [k for k in props if k in schema.get("required", [])]
        opt = [k for k in props if k not in req]

        def kv(key: str) -> str:
            is_req = required and key in req
            kname = self.add(f"t{tool}-k-" + "-".join(self.slug(p) if p != "[]" else "x" for p in (*path, key)),
                             lit(_jtext(key)), Role("key", tool, (*path, key), is_req))
            vname = self.value(props[key], tool, (*path, key), is_req)
            return f'{kname} ": " {vname}'

        if not props:
            return '"{}"'
        if req:
            body = ' ", " '.join(kv(k) for k in req)
            body += "".join(f' (", " {kv(k)})?' for k in opt)
            return f'"{{" {body} "}}"'
        kvs = [kv(k) for k in opt]
        alts = []
        for i, first in enumerate(kvs):
            alts.append(first + "".join(f' (", " {x})?' for x in kvs[i + 1:]))
        return '"{" (' + " | ".join(alts) + ')? "}"'

    @staticmethod
    def array_body(item: str, lo: int, hi: int | None) -> str:
        if hi == 0:
            return '"[]"'
        if lo == 0:
            tail = f'(", " {item})*' if hi is None else f'(", " {item}){{0,{hi - 1}}}'
            return f'"[" ({item} {tail})? "]"'
        tail = f'(", " {item}){{{lo - 1},}}' if hi is None else f'(", " {item}){{{lo - 1},{hi - 1}}}'
        return f'"[" {item} {tail} "]"'

    def any_value(self, name: str, role: Role, only: str | None = None) -> str:
        """A free-form JSON value with its own rules (so the role survives tail-position drops)."""
        kv = f"{name}-a-kv"
        obj = f'"{{" ({kv} (", " {kv})*)? "}}"'
        if only == "object":
            rule = self.add(name, obj, role)
        else:
            rule = self.add(name, " | ".join([obj, f'"[" ({name} (", " {name})*)? "]"', self.str_body, NUM_BODY,
                                              '"true"', '"false"', '"null"']), role)
        inner = name if only is None else self.any_value(f"{name}-a", role)
        self.add(kv, f'{self.str_body} ": " {inner}', role)
        return rule

    def call(self, i: int, tool: ToolSpec, ws: str | None = None) -> str:
        name_rule = self.add(f"t{i}-name", lit(_jtext(tool.name)), Role("name", i, (), True))
        args = self.value(tool.parameters, i, (), True)
        self.roles.pop(args, None)  # the arguments object itself is structure, not a value
        sep = '", "' if ws is None else f'"," {ws}'
        return self.add(f"t{i}-call", f'{name_rule} {sep} "\\"arguments\\": " {args}')


def _with_calls(tools: list[ToolSpec], max_string: int | None, max_calls: int | None,
                ws: str | None = None) -> _Builder:
    """The per-tool call rules and ``call``; ``ws``: a whitespace rule allowed around the call
    object's own keys (the fenced form, where the model pretty-prints the outer object)."""
    if max_calls is not None and max_calls < 1:
        raise ValueError("max_calls must be >= 1")
    b = _Builder(tools, max_string)
    calls = [b.call(i, t, ws) for i, t in enumerate(tools)]
    if ws is None:
        b.add("call", '"{\\"name\\": " (' + " | ".join(calls) + ') "}"')
    else:
        b.add("call", f'"{{" {ws} "\\"name\\": " (' + " | ".join(calls) + f') {ws} "}}"')
    b.add("char", CHAR_RULE.split("::=", 1)[1].strip())
    return b


def _grammar(b: _Builder, root: str, tools: list[ToolSpec], parallel: bool) -> CallGrammar:
    lines = [f"root ::= {root}"] + [f"{k} ::= {v}" for k, v in b.rules.items()]
    return CallGrammar(text="\n".join(lines) + "\n", tools=tools, parallel=parallel, roles=b.roles)


def build_grammar(tools: list[ToolSpec], parallel: bool = False, max_string: int | None = None,
                  max_calls: int | None = None) -> CallGrammar:
    """The GBNF grammar for a call (or a list of calls with ``parallel``) to one of ``tools``.

    ``max_string`` bounds the characters of every string value, ``max_calls`` the length of a
    parallel list (None: unbounded).
    """
    b = _with_calls(tools, max_string, max_calls)
    more = "*" if max_calls is None else f"{{0,{max_calls - 1}}}"
    return _grammar(b, f'"[" call (", " call){more} "]"' if parallel else "call", tools, parallel)


def build_native_grammar(tools: list[ToolSpec], open_text: str, close_text: str, sep: str, parallel: bool = False,
                         max_string: int | None = None, max_calls: int | None = None) -> CallGrammar:
    """A model's own call protocol: ``open_text`` call ``close_text`` (Hermes/Qwen: ``<tool_call>\\n``
    ... ``\\n</tool_call>``), or with ``parallel`` one or more such blocks joined by ``sep``. The
    call inside is the same ``{"name": ..., "arguments": {...}}`` object as ``build_grammar``'s."""
    b = _with_calls(tools, max_string, max_calls)
    b.add("block", f"{lit(open_text)} call {lit(close_text)}")
    more = "*" if max_calls is None else f"{{0,{max_calls - 1}}}"
    return _grammar(b, f"block ({lit(sep)} block){more}" if parallel else "block", tools, parallel)


def build_fenced_grammar(tools: list[ToolSpec], parallel: bool = False, max_string: int | None = None,
                         max_calls: int | None = None) -> CallGrammar:
    """Calls as markdown blocks (```` ```json\n{call}\n``` ````, or a bare ```` ``` ```` fence), the
    form Qwen2.5-Coder often writes instead of ``<tool_call>``: one block, or with ``parallel`` one or
    more separated by whitespace. The call is ``build_grammar``'s object, except that the outer
    object may be pretty-printed (up to 8 spaces, tabs or newlines after ``{``, after the comma and
    before ``}``): the model starts it that way before the grammar can steer it."""
    b = _with_calls(tools, max_string, max_calls, ws="fws")
    b.add("fws", "[ \\t\\n]{0,8}")
    b.add("fblock", f'{lit("```")} {lit("json")}? {lit(chr(10))} call {lit(chr(10) + "```")}')
    more = "*" if max_calls is None else f"{{0,{max_calls - 1}}}"
    return _grammar(b, f"fblock ([ \\t\\n]{{1,4}} fblock){more} [ \\t\\n]{{0,2}}" if parallel else "fblock",
                    tools, parallel)
