"""Once per catalog: a prefix compressed once (query-agnostic methods), or prefilled once (whole-prompt methods).

``pask-local eval --methods once:pask-prior`` (any query-agnostic method after ``once:``; ``once:full``
is Full KV restored from its saved prefix) compresses each distinct prefix (system + tools + examples,
up to the user's turn: a catalog group's shared prefix) once, without any question, as
``pask-local compress`` does, and answers every case with that prefix from a restored copy, as
``run --prefix`` / ``serve --prefix`` do (``prefix.build``). The first case of a prefix records
the compression's time (``prefix_compress_s``); every case records the prefix length it did not
prefill (``n_reused``) and what the prefix holds (``prefix_held_share``).

``SharedCatalogGenerator``: a method that prefills the whole prompt before it compresses (SnapKV,
PyramidKV, pask-attn, pask-hybrid) on a catalog workload. Its prefill of the group's prefix is the
same for every case, so it is done once and held whole (the method at budget 1.0 keeps everything);
each case restores a copy, reads its own question and compresses as a run of its own does, its
observation window on the question (``Run._adopt_prefix`` holds a reused prefix whole). Only the
first case of a group pays the catalog's prefill (``prefix_prefill_s``). Cases without a catalog run
as ``EngineGenerator`` runs them.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..errors import PaskError
from .data import Case
from .generator import ONCE, EngineGenerator, GenerationOutput, GeneratorSpec, _engine_output, _failed
from .prompting import make_task


class PrefixOnceGenerator:
    """Generates with ``base`` (a query-agnostic method) from prefixes compressed once."""

    def __init__(self, base: str, spec: GeneratorSpec) -> None:
        from ..engine import Engine
        from ..llm import Model
        from ..prefix.build import check_query_agnostic

        check_query_agnostic(base)
        self.base = base
        self.method = ONCE + base
        self.budget = spec.budget
        if (base == "full") != (spec.budget is None):
            raise PaskError(f"method {self.method!r}: {'no' if base == 'full' else 'a'} KV budget expected")
        self.spec = spec
        self.model = Model(spec.gguf)
        self.engine = Engine(self.model, spec.method(base, self.model), spec.engine_config(spec.budget or 1.0))
        self._prefixes: dict[str, tuple[Any, Any, float]] = {}  # key -> (header, pinned, compress seconds)

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "budget": self.budget, "max_tokens": self.spec.max_tokens,
                "compressed_once": True}

    def _prefix(self, key: str, tools: list[Any], head: list[Any], examples: Any,
                parallel: bool) -> tuple[Any, Any, float, bool]:
        from ..prefix.build import compress, pin

        got = self._prefixes.get(key)
        if got is not None:
            return (*got, False)
        c = compress(self.engine, tools, head, examples=examples, parallel=parallel)
        budget = None if self.base == "full" else self.budget
        pinned = pin("eval-prefix", c.header, c.state, self.model, self.base, budget, self.spec.kv_type)
        self._prefixes[key] = (c.header, pinned, c.prefill_s)
        return c.header, pinned, c.prefill_s, True

    def generate(self, case: Case) -> GenerationOutput:
        from ..prefix.build import check_prompt, run_from_prefix
        from ..schema.tools import as_tools

        t0 = time.perf_counter()
        task = make_task(case, self.spec.use_examples)
        msgs = task.conversation()
        try:
            tools = as_tools(task.functions)
            head = list(msgs[:-1])
            key = json.dumps([case.tools or case.functions, [repr(m) for m in head], task.examples,
                              task.parallel], sort_keys=True, default=str)
            header, pinned, compress_s, first = self._prefix(key, tools, head, task.examples, task.parallel)
            prepared = self.engine.prepare(msgs, tools, "required", parallel=task.parallel, examples=task.examples)
            check_prompt(header, prepared.plan.prompt.tokens, "the compressed prefix")
            res = run_from_prefix(self.engine, prepared, pinned)
        except PaskError as exc:
            return _failed(f"{type(exc).__name__}: {exc}", t0)
        out = _engine_output(res, time.perf_counter() - t0)
        out.n_reused = header.n_prefix
        out.extra.update({"prefix_tokens": header.n_prefix,
                          "prefix_held_share": round(header.held() / (header.n_prefix * header.n_layer), 4),
                          "prefix_compress_s": round(compress_s, 3) if first else 0.0})
        return out

    def close(self) -> None:
        self.model.close()


class SharedCatalogGenerator(EngineGenerator):
    """A whole-prompt method whose catalog prefix is prefilled once per group (module doc)."""

    def __init__(self, method: str, spec: GeneratorSpec) -> None:
        import dataclasses

        from ..engine import Engine

        super().__init__(method, spec)
        # the same method, holding everything: what a prefill of the prefix alone leaves
        self.holder = Engine(self.model, self.engine.method, dataclasses.replace(self.engine.cfg, budget=1.0))
        self._prefixes: dict[str, tuple[Any, Any, float]] = {}

    def _prefix(self, key: str, tools: list[Any], head: list[Any], examples: Any,
                parallel: bool) -> tuple[Any, Any, float, bool]:
        from ..engine.pool import Pinned
        from ..prefix import state as kv_state
        from ..prefix.build import prefill_prefix

        got = self._prefixes.get(key)
        if got is not None:
            return (*got, False)
        prefix, blob, _, seconds, _ = prefill_prefix(self.holder, tools, head, examples, parallel)
        pinned = Pinned(tuple(prefix.tokens), self.engine.method.name, self.budget,
                        lambda ctx, seq: kv_state.restore(ctx, seq, blob))
        self._prefixes[key] = (prefix, pinned, seconds)
        return prefix, pinned, seconds, True

    def generate(self, case: Case) -> GenerationOutput:
        if case.tools is None:
            return super().generate(case)
        from ..prefix.build import run_from_prefix
        from ..schema.tools import as_tools

        t0 = time.perf_counter()
        task = make_task(case, self.spec.use_examples)
        msgs = task.conversation()
        try:
            tools = as_tools(task.functions)
            head = list(msgs[:-1])
            key = json.dumps([case.tools, [repr(m) for m in head], task.examples, task.parallel],
                             sort_keys=True, default=str)
            prefix, pinned, prefill_s, first = self._prefix(key, tools, head, task.examples, task.parallel)
            prepared = self.engine.prepare(msgs, tools, "required", parallel=task.parallel, examples=task.examples)
            n = len(prefix.tokens)
            if list(prepared.plan.prompt.tokens[:n]) != list(prefix.tokens) or prepared.n_prompt <= n:
                raise PaskError("the case's prompt does not start with its group's catalog prefix")
            res = run_from_prefix(self.engine, prepared, pinned)
        except PaskError as exc:
            return _failed(f"{type(exc).__name__}: {exc}", t0)
        out = _engine_output(res, time.perf_counter() - t0)
        out.n_reused = n
        out.extra.update({"prefix_tokens": n, "prefix_prefill_s": round(prefill_s, 3) if first else 0.0})
        return out
