"""One grammar-constrained function call with full KV: prompt -> call text, JSON, classes, timings.

``generate_call`` renders and tags the prompt, decodes it, then runs our own decode loop on the
low-level API: the fast constrained sampler picks each token, the tagger accepts it into the
grammar and classifies it, and the loop stops when the grammar is complete (or at EOG or
``max_tokens``). The output is parsed and validated with ``jsonschema`` against the called tool's
parameters. The engine reuses these pieces; until it exists the CLI and the eval harness call this.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from .classes import StructuralClass
from .errors import NativeError, PaskError
from .grammar.sampler import ConstrainedSampler, SamplerStats
from .grammar.state import GrammarState
from .llm import Context, Model
from .schema.gbnf import CallGrammar, build_grammar
from .schema.tools import ToolSpec, as_tools
from .tagging.generated import CallTagger
from .tagging.prompt import Prompt, render_prompt


@dataclass
class CallResult:
    """The outcome of ``generate_call``; ``error`` is None when the output parsed and validated."""

    text: str
    calls: list[dict[str, Any]]            # parsed calls (one element unless parallel)
    parsed: Any                            # the parsed JSON as generated (dict, or list if parallel)
    tokens: list[int]
    classes: list[StructuralClass]         # one per generated token
    prompt: Prompt
    grammar: CallGrammar
    timings: dict[str, float] = field(default_factory=dict)
    stats: SamplerStats = field(default_factory=SamplerStats)
    finish: str = "grammar"                # grammar | eog | length
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def validate_calls(parsed: Any, tools: list[ToolSpec], parallel: bool) -> tuple[list[dict[str, Any]], str | None]:
    """The calls in ``parsed`` and the first validation error (None when all are valid)."""
    calls = parsed if parallel else [parsed]
    if not isinstance(calls, list):
        return [], "expected a list of calls"
    by_name = {t.name: t for t in tools}
    for c in calls:
        if not isinstance(c, dict) or set(c) != {"name", "arguments"}:
            return calls, "a call must be {\"name\": ..., \"arguments\": {...}}"
        tool = by_name.get(c["name"])
        if tool is None:
            return calls, f"unknown tool '{c['name']}'"
        # as jsonschema.validate, without checking the schema again: load_tools checked it once
        exc = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(tool.parameters).iter_errors(c["arguments"]))
        if exc is not None:
            return calls, f"arguments of '{tool.name}' do not validate: {exc.message}"
    return calls, None


def parse_output(text: str, finish: str, max_tokens: int, tools: list[ToolSpec], parallel: bool
                 ) -> tuple[Any, list[dict[str, Any]], str | None]:
    """(parsed JSON, calls, first error or None) for a generated call text."""
    if finish == "length":
        return None, [], f"the call did not finish within max_tokens={max_tokens}"
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, [], f"output is not valid JSON: {exc.msg}"
    calls, error = validate_calls(parsed, tools, parallel)
    return parsed, calls, error


def generate_call(model: Model, ctx: Context, tools: Any, request: str, parallel: bool = False,
                  max_tokens: int = 256, examples: list[tuple[str, str]] | None = None,
                  temperature: float = 0.0, style: str = "auto", seed: int = 0,
                  max_string: int | None = None) -> CallResult:
    """Generate one constrained call (or a list with ``parallel``) for ``request`` with full KV.

    ``examples``: few-shot (request, call JSON) pairs; ``max_string`` bounds string values.
    """
    import numpy as np

    specs = as_tools(tools)
    t0 = time.perf_counter()
    grammar = build_grammar(specs, parallel, max_string=max_string)
    prompt = render_prompt(model, specs, request, examples=examples, parallel=parallel, style=style)
    if len(prompt.tokens) + max_tokens > ctx.n_ctx:
        raise PaskError(f"prompt ({len(prompt.tokens)} tokens) + max_tokens ({max_tokens}) exceed the context "
                        f"size {ctx.n_ctx}")
    state = GrammarState(model.vocab, grammar.text)
    sampler = ConstrainedSampler(state, rng=np.random.default_rng(seed))
    tagger = CallTagger(model, grammar, state)
    t1 = time.perf_counter()

    ctx.clear()
    if ctx.decode(prompt.tokens, 0) != 0:
        raise NativeError("llama_decode failed on the prompt")
    logits = ctx.logits()
    t2 = time.perf_counter()

    out: list[int] = []
    classes: list[StructuralClass] = []
    finish = "length"
    t_sample = t_tag = t_decode = 0.0
    pos = len(prompt.tokens)
    for _ in range(max_tokens):
        a = time.perf_counter()
        tok = sampler.sample(logits, temperature) if temperature > 0 else sampler.greedy(logits)
        b = time.perf_counter()
        t_sample += b - a
        if model.is_eog(tok):
            finish = "eog"
            break
        classes.append(tagger.accept(tok, model.piece(tok)))
        out.append(tok)
        c = time.perf_counter()
        t_tag += c - b
        if state.is_done():
            finish = "grammar"
            break
        if ctx.decode([tok], pos) != 0:
            raise NativeError("llama_decode failed during generation")
        pos += 1
        logits = ctx.logits()
        t_decode += time.perf_counter() - c
    t3 = time.perf_counter()
    state.close()

    text = b"".join(model.piece(t) for t in out).decode("utf-8", "replace")
    parsed, calls, error = parse_output(text, finish, max_tokens, specs, parallel)
    n = max(1, len(out))
    timings = {
        "setup_ms": (t1 - t0) * 1e3, "prompt_ms": (t2 - t1) * 1e3, "gen_ms": (t3 - t2) * 1e3,
        "sample_ms": t_sample * 1e3, "tag_ms": t_tag * 1e3, "decode_ms": t_decode * 1e3,
        "ms_per_token": (t3 - t2) * 1e3 / n, "n_prompt": float(len(prompt.tokens)), "n_gen": float(len(out)),
    }
    return CallResult(text=text, calls=calls, parsed=parsed, tokens=out, classes=classes, prompt=prompt,
                      grammar=grammar, timings=timings, stats=sampler.stats, finish=finish, error=error)
