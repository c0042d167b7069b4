"""Once per catalog: a prefix compressed once (query-agnostic methods), or prefilled once (whole-prompt methods).

``pask-local eval --methods once:pask-prior`` (any query-agnostic method after ``once:``; ``once:full``
is Full KV restored from its saved prefix) compresses each distinct prefix (system + tools + examples,
up to the user's turn: a catalog group's shared prefix) once, without any question, as
``pask-local compress`` does, and answers every case with that prefix from a restored copy, as
``run --prefix`` / ``serve --prefix`` do (``prefix.build``). The first case of a prefix records
the compression's time (``prefix_compress_s``); every case records the prefix length it did not
prefill (``n_reused``) and what the prefix holds (``prefix_held_share``).

``SharedCatalogGenerator``: a method that prefills the whole prompt before it compresses (SnapKV,
PyramidKV, pask-attn, pask-hybrid; a planned method under ``--whole-prefill``, which then drops what
its plan does not keep) on a catalog workload. Its prefill of the group's prefix is the same for
every case, so it is done once and held whole (the method at budget 1.0 keeps everything); each case
restores a copy, reads its own question and compresses as a run of its own does, its observation
window or its plan on the whole prompt, question included (``Run._adopt_prefix`` holds a reused
prefix whole). Only the first case of a group pays the catalog's prefill (``prefix_prefill_s``).
Cases without a catalog, and a method with a scoring pass, run as ``EngineGenerator`` runs them.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from ..errors import PaskError
from .data import Case
from .generator import ONCE, EngineGenerator, GenerationOutput, GeneratorSpec, _engine_output, _failed
from .prompting import make_task

Prefix = tuple[list[int], Any, float, dict[str, Any]]  # tokens, the Pinned prefix, seconds to build, stats


class _FromPrefixes:
    """What both generators share: one prefix per distinct (tools, head, examples, call shape), built
    once by ``_build``, and every case run from a restored copy of its prefix (``run_from_prefix``)."""

    engine: Any
    spec: GeneratorSpec
    seconds_key: str  # the stat naming how the prefix was built (on its first case; 0 on the others)
    _prefixes: dict[str, Prefix]  # by key: each subclass's __init__ starts it empty

    def _build(self, tools: list[Any], head: list[Any], examples: Any, parallel: bool) -> Prefix:
        raise NotImplementedError

    def _from_prefix(self, case: Case) -> GenerationOutput:
        from ..prefix.build import check_prompt, run_from_prefix
        from ..schema.tools import as_tools

        t0 = time.perf_counter()
        task = make_task(case, self.spec.use_examples)
        msgs = task.conversation()
        prefixes = self._prefixes
        try:
            tools = as_tools(task.functions)
            head = list(msgs[:-1])
            key = json.dumps([task.functions, [repr(m) for m in head], task.examples, task.parallel],
                             sort_keys=True, default=str)
            first = key not in prefixes
            if first:
                prefixes[key] = self._build(tools, head, task.examples, task.parallel)
            tokens, pinned, seconds, stats = prefixes[key]
            prepared = self.engine.prepare(msgs, tools, "required", parallel=task.parallel, examples=task.examples)
            check_prompt(tokens, prepared.plan.prompt.tokens, "its catalog group")
            res = run_from_prefix(self.engine, prepared, pinned)
        except PaskError as exc:
            return _failed(f"{type(exc).__name__}: {exc}", t0)
        out = _engine_output(res, time.perf_counter() - t0)
        out.n_reused = len(tokens)
        out.extra.update({"prefix_tokens": len(tokens), **stats,
                          self.seconds_key: round(seconds, 3) if first else 0.0})
        return out


class PrefixOnceGenerator(_FromPrefixes):
    """Generates with ``base`` (a query-agnostic method) from prefixes compressed once."""

    seconds_key = "prefix_compress_s"

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
        self.model = Model(spec.gguf, placement=spec.placement)
        # --whole-prefill is the prefix's compression (``compress(whole=...)``); a case on the restored
        # prefix reads its question as ``run --prefix`` does
        cfg = dataclasses.replace(spec.engine_config(spec.budget or 1.0), plan_after_prefill=False)
        self.engine = Engine(self.model, spec.method(base, self.model), cfg)
        self._prefixes = {}
        m = self.engine.method
        # a planned method prefilling whole drops from a whole prefill of the prefix, which the eval's
        # other such runs share (``prefix.whole``); the holder makes it (budget 1.0). A scoring pass still
        # runs (memoized): the prompt compressed is the prefix alone, which the restored part (all but its
        # last token) does not cover
        self.holder = (Engine(self.model, m, dataclasses.replace(self.engine.cfg, budget=1.0))
                       if spec.whole_prefill and m.plans_prompt else None)
        self.whole_prefills = _whole_prefills(spec)

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "budget": self.budget, "max_tokens": self.spec.max_tokens,
                "compressed_once": True}

    def _build(self, tools: list[Any], head: list[Any], examples: Any, parallel: bool) -> Prefix:
        from ..prefix.build import compress, pin

        start, shared = None, {}
        if self.holder is not None:
            whole, paid = self.whole_prefills.get(self.holder, tools, head, examples, parallel)
            start = whole.pinned(self.engine.method.name, self.engine.cfg.budget, drop_last=True)
            shared = {"whole_prefill_s": round(whole.seconds, 3) if paid else 0.0, "whole_prefill_shared": not paid}
        c = compress(self.engine, tools, head, examples=examples, parallel=parallel, whole=self.spec.whole_prefill,
                     start=start)
        budget = None if self.base == "full" else self.budget
        pinned = pin("eval-prefix", c.header, c.state, self.model, self.base, budget, self.spec.kv_type)
        h = c.header
        return h.tokens, pinned, c.prefill_s, {"prefix_held_share": round(h.held() / (h.n_prefix * h.n_layer), 4),
                                               **shared}

    def generate(self, case: Case) -> GenerationOutput:
        return self._from_prefix(case)

    def close(self) -> None:
        self.model.close()


class SharedCatalogGenerator(_FromPrefixes, EngineGenerator):
    """A whole-prompt method whose catalog prefix is prefilled once per group (module doc)."""

    seconds_key = "prefix_prefill_s"

    def __init__(self, method: str, spec: GeneratorSpec) -> None:
        from ..engine import Engine

        super().__init__(method, spec)
        # the same method, holding everything: what a prefill of the prefix alone leaves
        self.holder = Engine(self.model, self.engine.method, dataclasses.replace(self.engine.cfg, budget=1.0))
        self._prefixes = {}
        self.whole_prefills = _whole_prefills(spec)

    def _build(self, tools: list[Any], head: list[Any], examples: Any, parallel: bool) -> Prefix:
        whole, paid = self.whole_prefills.get(self.holder, tools, head, examples, parallel)
        return (list(whole.tokens), whole.pinned(self.engine.method.name, self.budget),
                whole.seconds if paid else 0.0, {"prefix_prefill_shared": not paid})

    def generate(self, case: Case) -> GenerationOutput:
        return super().generate(case) if case.tools is None else self._from_prefix(case)


def _whole_prefills(spec: GeneratorSpec) -> Any:
    """The eval's shared whole prefills, or this generator's own (``--no-share-prefill``)."""
    from ..prefix.whole import WholePrefills

    return spec.whole_prefills if spec.whole_prefills is not None else WholePrefills()
