"""Reads and validates an engine trace (docs/trace-format.md), whole or line by line.

``load_trace(path)`` parses a finished trace file; ``TraceReader`` takes lines one at a time (for a
live view of a run in progress). Every problem is a ``TraceError`` (a ``PaskError``) whose one-line
message names the file, the line and what is wrong. No Textual here: the replay and the tests use it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pask_local.classes import StructuralClass
from pask_local.errors import PaskError

TRACE_VERSION = 1
KNOWN_RULES = ("policy", "window", "score")


class TraceError(PaskError):
    """A trace file is missing, unreadable, corrupt or truncated."""


@dataclass(frozen=True)
class Header:
    model: str
    n_layer: int
    groups: list[list[int]]
    method: str
    budget: float | None   # None: no budget (full KV)
    request: str
    policy: dict[str, Any] | None
    capacity: list[int]
    swa_layers: tuple[int, ...] = ()   # optional in the trace: sliding-window layers and their window
    window: int = 0

    @property
    def n_groups(self) -> int:
        return len(self.groups)

    def group_of(self, layer: int) -> int:
        for g, layers in enumerate(self.groups):
            if layer in layers:
                return g
        raise KeyError(layer)


@dataclass(frozen=True)
class Token:
    pos: int
    id: int
    text: str
    cls: StructuralClass
    phase: str  # "prompt" | "gen"


@dataclass(frozen=True)
class Evict:
    step: int
    layer: int
    group: int
    positions: tuple[int, ...]
    rule: str
    line: int


@dataclass(frozen=True)
class Step:
    step: int
    pos: int
    kept: list[int]
    ms: float
    line: int


@dataclass(frozen=True)
class Final:
    output: str
    valid: bool
    retained: dict[int, list[int]]
    n_prompt: int
    n_gen: int
    ms_per_token: float


@dataclass
class Trace:
    """A parsed trace; ``final`` is None while a live run is still going."""

    source: str
    header: Header
    tokens: list[Token] = field(default_factory=list)
    evicts: list[Evict] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    final: Final | None = None

    @property
    def n_prompt(self) -> int:
        return sum(1 for t in self.tokens if t.phase == "prompt")

    @property
    def n_gen(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def complete(self) -> bool:
        return self.final is not None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    """A finite JSON number (Python's json reads NaN and Infinity, which no trace writer emits)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


class TraceReader:
    """Validates trace lines in order; ``trace`` is usable (partially) after the header line."""

    def __init__(self, source: str = "trace") -> None:
        self.source = source
        self.lineno = 0
        self.trace: Trace | None = None
        self._n_prompt = 0
        self._gen_started = False
        self._evicted: list[dict[int, int]] = []  # per layer: position -> line that evicted it
        self._last_evict_step = -1

    # ------------------------------------------------------------- errors
    def _fail(self, what: str) -> TraceError:
        what = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in what)  # one line, whatever the input
        return TraceError(f"{self.source}, line {self.lineno}: {what}")

    # --------------------------------------------------------------- input
    def feed_line(self, text: str, *, cut: bool = False) -> None:
        """Parse and check one line. ``cut``: the line had no newline at the end of the file."""
        self.lineno += 1
        if not text.strip():
            raise self._fail("empty line")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            if cut:
                raise self._fail(f"the line is cut off (file truncated?): {exc.msg}") from None
            raise self._fail(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise self._fail("JSON nested too deeply") from None
        self.feed(obj)

    def feed(self, obj: Any) -> None:
        """Check one already-decoded line."""
        if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
            raise self._fail("expected a JSON object with a \"type\"")
        kind = obj["type"]
        if self.trace is None:
            if kind != "header":
                raise self._fail(f"the first line must be the header, got a '{kind}' line")
            self.trace = Trace(self.source, self._header(obj))
            self._evicted = [{} for _ in range(self.trace.header.n_layer)]
            return
        if self.trace.final is not None:
            raise self._fail(f"a '{kind}' line after the final line")
        handler = {"token": self._token, "evict": self._evict, "step": self._step, "final": self._final}.get(kind)
        if handler is None:
            raise self._fail(f"unknown line type '{kind}'" if kind != "header" else "a second header line")
        handler(obj)

    def finish(self, require_final: bool = True) -> Trace:
        """The trace read so far; with ``require_final`` a trace without its final line is an error."""
        if self.trace is None:
            raise TraceError(f"{self.source}: empty trace (no header line)")
        if require_final and self.trace.final is None:
            raise TraceError(f"{self.source}: truncated after line {self.lineno}: no final line "
                             "(the run was cut short or the file is incomplete)")
        return self.trace

    # ---------------------------------------------------------- line kinds
    def _need(self, obj: dict, key: str, check, what: str) -> Any:
        if key not in obj:
            raise self._fail(f"'{obj['type']}' line without \"{key}\"")
        v = obj[key]
        if not check(v):
            raise self._fail(f"\"{key}\" must be {what}, got {json.dumps(v)[:60]}")
        return v

    def _header(self, o: dict) -> Header:
        version = o.get("version")
        if version != TRACE_VERSION:
            raise self._fail(f"unsupported trace version {version!r} (this viewer reads version {TRACE_VERSION})")
        n_layer = self._need(o, "n_layer", lambda v: _is_int(v) and v > 0, "a positive integer")
        groups = self._need(o, "groups", lambda v: isinstance(v, list) and v and all(
            isinstance(g, list) and g and all(_is_int(i) for i in g) for g in v), "a list of layer lists")
        flat = sorted(i for g in groups for i in g)
        if len(flat) != n_layer or flat != list(range(n_layer)):  # length first: n_layer may be absurd
            raise self._fail(f"\"groups\" must cover layers 0..{n_layer - 1} exactly once")
        capacity = self._need(o, "capacity", lambda v: isinstance(v, list) and all(_is_int(c) and c >= 0 for c in v),
                              "a list of non-negative integers")
        if len(capacity) != n_layer:
            raise self._fail(f"\"capacity\" has {len(capacity)} entries for {n_layer} layers")
        policy = o.get("policy")
        if policy is not None and not isinstance(policy, dict):
            raise self._fail("\"policy\" must be an object or null")
        swa = o.get("swa_layers", [])
        window = o.get("window", 0)
        if not (isinstance(swa, list) and all(_is_int(i) and 0 <= i < n_layer for i in swa)) or not (_is_int(window) and window >= 0):
            raise self._fail("\"swa_layers\" must list layer indices and \"window\" be an integer")
        method = self._need(o, "method", lambda v: isinstance(v, str) and v, "a method name")
        budget = self._need(o, "budget", lambda v: v is None or (_is_num(v) and 0 < v <= 1),
                            "a number in (0, 1] or null")
        if method == "full":
            budget = None  # full KV has no budget (traces written before budget null carry the CLI's)
        elif budget is None:
            raise self._fail(f"\"budget\" is null, but only full KV runs have no budget (method '{method}')")
        return Header(
            model=self._need(o, "model", lambda v: isinstance(v, str), "a string"),
            n_layer=n_layer, groups=[list(g) for g in groups], method=method,
            budget=None if budget is None else float(budget),
            request=str(o.get("request", "")), policy=policy, capacity=list(capacity),
            swa_layers=tuple(swa), window=window,
        )

    def _token(self, o: dict) -> None:
        t = self.trace
        assert t is not None
        pos = self._need(o, "pos", _is_int, "an integer")
        if pos != len(t.tokens):
            raise self._fail(f"token at position {pos}, expected position {len(t.tokens)} (tokens must be in order)")
        cls_name = self._need(o, "cls", lambda v: isinstance(v, str), "a class name")
        try:
            cls = StructuralClass(cls_name)
        except ValueError:
            raise self._fail(f"unknown structural class '{cls_name}'") from None
        phase = self._need(o, "phase", lambda v: v in ("prompt", "gen"), "\"prompt\" or \"gen\"")
        if phase == "prompt":
            if self._gen_started:
                raise self._fail(f"prompt token at position {pos} after generated tokens")
            self._n_prompt += 1
        else:
            self._gen_started = True
            expected_step = pos - self._n_prompt
            if expected_step != len(t.steps):
                raise self._fail(f"generated token at position {pos} before the step line of step "
                                 f"{len(t.steps)}")
        t.tokens.append(Token(pos=pos, id=self._need(o, "id", _is_int, "an integer"),
                              text=self._need(o, "text", lambda v: isinstance(v, str), "a string"),
                              cls=cls, phase=phase))

    def _evict(self, o: dict) -> None:
        t = self.trace
        assert t is not None
        h = t.header
        step = self._need(o, "step", lambda v: _is_int(v) and v >= -1, "an integer >= -1")
        layer = self._need(o, "layer", lambda v: _is_int(v) and 0 <= v < h.n_layer, f"a layer in 0..{h.n_layer - 1}")
        group = self._need(o, "group", _is_int, "an integer")
        if group != h.group_of(layer):
            raise self._fail(f"layer {layer} is in group {h.group_of(layer)}, the line says group {group}")
        positions = self._need(o, "positions", lambda v: isinstance(v, list) and all(_is_int(p) for p in v),
                               "a list of positions")
        rule = self._need(o, "rule", lambda v: isinstance(v, str) and v, "a rule name")
        if step < self._last_evict_step:
            raise self._fail(f"eviction for step {step} after one for step {self._last_evict_step}")
        if 0 <= step < len(t.steps):
            raise self._fail(f"eviction for step {step} after that step's step line")
        if step == -1 and self._gen_started:
            raise self._fail("prefill eviction (step -1) after generated tokens")
        n_seq = self._n_prompt + step + 1
        if step >= 0 and len(t.tokens) < n_seq:
            raise self._fail(f"eviction for step {step} before the token of that step")
        limit = min(n_seq, len(t.tokens))
        seen = self._evicted[layer]
        for p in positions:
            if not 0 <= p < limit:
                raise self._fail(f"evicts position {p}, which does not exist at step {step}")
            if p in seen:
                raise self._fail(f"position {p} evicted twice from layer {layer} (first on line {seen[p]})")
            seen[p] = self.lineno
        self._last_evict_step = step
        t.evicts.append(Evict(step=step, layer=layer, group=group, positions=tuple(positions), rule=rule,
                              line=self.lineno))

    def _step(self, o: dict) -> None:
        t = self.trace
        assert t is not None
        step = self._need(o, "step", _is_int, "an integer")
        if step != len(t.steps):
            raise self._fail(f"step {step}, expected step {len(t.steps)}")
        pos = self._need(o, "pos", _is_int, "an integer")
        if pos != self._n_prompt + step:
            raise self._fail(f"step {step} at position {pos}, expected {self._n_prompt + step}")
        if len(t.tokens) <= pos:
            raise self._fail(f"step {step} before the token at position {pos}")
        kept = self._need(o, "kept", lambda v: isinstance(v, list) and all(_is_int(k) and k >= 0 for k in v),
                          "a list of non-negative integers")
        if len(kept) != t.header.n_groups:
            raise self._fail(f"\"kept\" has {len(kept)} entries for {t.header.n_groups} groups")
        ms = o.get("ms", 0.0)
        t.steps.append(Step(step=step, pos=pos, kept=list(kept), ms=float(ms) if _is_num(ms) else 0.0,
                            line=self.lineno))

    def _final(self, o: dict) -> None:
        t = self.trace
        assert t is not None
        retained = self._need(o, "retained", lambda v: isinstance(v, dict) and all(
            isinstance(p, list) and all(_is_int(i) and 0 <= i < len(t.tokens) for i in p) for p in v.values()),
            "an object of lists of positions in the trace")
        want = {str(g) for g in range(t.header.n_groups)}
        if set(retained) != want:
            raise self._fail(f"\"retained\" must have keys {sorted(want)}, got {sorted(retained)}")
        n_prompt = self._need(o, "n_prompt", _is_int, "an integer")
        n_gen = self._need(o, "n_gen", _is_int, "an integer")
        if n_prompt != self._n_prompt or n_gen != len(t.tokens) - self._n_prompt:
            raise self._fail(f"final says {n_prompt} prompt + {n_gen} generated tokens, the trace has "
                             f"{self._n_prompt} + {len(t.tokens) - self._n_prompt}")
        mspt = o.get("ms_per_token", 0.0)
        t.final = Final(output=str(o.get("output", "")), valid=bool(o.get("valid", False)),
                        retained={int(k): list(v) for k, v in retained.items()}, n_prompt=n_prompt, n_gen=n_gen,
                        ms_per_token=float(mspt) if _is_num(mspt) else 0.0)


def read_lines(reader: TraceReader, data: str) -> None:
    """Feed every line of ``data`` (a whole file's text) to ``reader``."""
    lines = data.split("\n")
    cut = not data.endswith("\n")
    if not cut:
        lines.pop()  # the empty string after the final newline
    for i, line in enumerate(lines):
        is_last = i == len(lines) - 1
        reader.feed_line(line, cut=cut and is_last)


def load_trace(path: str | Path, require_final: bool = True) -> Trace:
    """Parse and validate the trace file at ``path`` (TraceError with file and line on any problem)."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"trace file not found: {p}")
    if not p.is_file():
        raise TraceError(f"not a trace file (a directory?): {p}")
    try:
        data = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{p}: not UTF-8 text (byte {exc.start}); is this a trace file?") from None
    except OSError as exc:
        raise TraceError(f"cannot read trace file {p}: {exc.strerror}") from None
    if not data.strip():
        raise TraceError(f"{p}: empty trace file")
    reader = TraceReader(str(p))
    read_lines(reader, data)
    return reader.finish(require_final)
