"""The Generator protocol the harness drives, the method registry, and the two generators.

A generator turns one ``Case`` into a ``GenerationOutput``. ``make_generator(method, spec)`` builds
one by name: ``full`` is ``FullKVGenerator``; every other method (streaming, h2o, snapkv, pyramidkv,
tova, pask) runs through the KV engine (``EngineGenerator``) at the spec's budget.

Both use the same protocol (``--prompt-style``: the model's own tool-call protocol or the instruction
prompt, ``chat.protocol``), grammar and greedy constrained decoder, so their outputs differ only
through the KV cache; native output is handed to the checker as the call JSON it expects. ``FullKVGenerator`` keeps the tokens currently in its KV cache and, for
each case, reuses their longest common prefix with the new prompt (dropping the rest with
``llama_memory_seq_rm``): the instructions, and the tool list when consecutive cases share it, are
decoded once instead of once per case. A failure that belongs to the case (a schema the grammar
builder rejects, a prompt longer than the context) is returned as ``error`` and scores invalid.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import PaskError
from ..methods.registry import METHOD_NAMES, QUERY_AGNOSTIC
from .data import Case
from .prompting import ENGINE_STYLES, Task, checker_text, make_task, task_plan

ONCE = "once:"  # a query-agnostic method compressed once per prefix (eval.prefix_once)
# the registry's (methods.registry), and each query-agnostic one compressed once
KNOWN_METHODS: tuple[str, ...] = METHOD_NAMES + tuple(ONCE + n for n in QUERY_AGNOSTIC)


@dataclass
class GenerationOutput:
    text: str                  # the generated call text (handed to the checker)
    n_prompt: int              # prompt tokens of this case
    n_reused: int              # prompt tokens served from the prefix cache (not decoded again)
    n_generated: int
    seconds: float             # wall time of this case (prompt build, prefill, decoding)
    prefill_seconds: float
    finish: str = ""           # grammar | eog | length | error
    error: str | None = None   # a per-case failure (schema, context); the case scores invalid
    extra: dict[str, Any] = field(default_factory=dict)


class Generator(Protocol):
    method: str
    budget: float | None

    def generate(self, case: Case) -> GenerationOutput: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class GeneratorSpec:
    """What a generator needs: the model file, the KV budget (None for full), and run settings."""

    gguf: Path
    budget: float | None = None
    max_tokens: int = 256
    n_ctx: int = 8192
    reuse_prefix: bool = True
    use_examples: bool = True
    prompt_style: str = "auto"     # auto | native | plain (eval.prompting.PROMPT_STYLES)
    hysteresis: float = 0.02       # EngineConfig.hysteresis (the native step's batched eviction)
    compact: bool = True           # EngineConfig.compact (gather kept cells after a one-time compression)
    kv_type: str = "f16"           # EngineConfig.kv_type (K/V element type; quantized: flash attention)
    policy: Path | None = None     # a policy file for the methods that take one (engine POLICY_METHODS)
    shared_catalog: bool = False   # whole-prompt methods prefill each catalog prefix once (eval.prefix_once)
    placement: Any = None          # rpc.Placement of the model's layers (--rpc, --ngl); None: PASK_NGL
    whole_prefill: bool = False    # a planned method prefills the prompt (a prefix compressed once) whole first
    # whole prefills of catalog prefixes shared by the eval's runs (prefix.whole.WholePrefills); None: not shared
    whole_prefills: Any = field(default=None, compare=False)

    def method(self, name: str, model: Any) -> Any:
        """The Method ``name`` on ``model``, with this spec's policy file where the method takes one."""
        from ..engine import make_method
        from ..methods.registry import POLICY_METHODS

        return make_method(name, model, self.policy if name in POLICY_METHODS else None)

    def engine_config(self, budget: float) -> Any:
        """The ``EngineConfig`` a method runs this spec with (budget, limit, prompt style, hysteresis)."""
        from ..engine import EngineConfig

        return EngineConfig(budget=budget, max_tokens=self.max_tokens, style=ENGINE_STYLES[self.prompt_style],
                            hysteresis=self.hysteresis, compact=self.compact, kv_type=self.kv_type,
                            plan_after_prefill=self.whole_prefill)


def check_methods(names: list[str]) -> list[str]:
    """Validate method names (PaskError for unknown ones); duplicates removed, order kept."""
    for name in names:
        if name not in KNOWN_METHODS:
            raise PaskError(f"unknown method {name!r}; choose from {', '.join(KNOWN_METHODS)}")
    return list(dict.fromkeys(names))


def make_generator(method: str, spec: GeneratorSpec) -> Generator:
    check_methods([method])
    if method.startswith(ONCE):
        from .prefix_once import PrefixOnceGenerator

        return PrefixOnceGenerator(method.removeprefix(ONCE), spec)
    if method == "full":
        return FullKVGenerator(spec)
    if spec.shared_catalog and _shares_catalog_prefill(method, spec):
        from .prefix_once import SharedCatalogGenerator

        return SharedCatalogGenerator(method, spec)
    return EngineGenerator(method, spec)


def _prefills_whole(method: str) -> bool:
    from ..methods.registry import REGISTRY, PrefillMode

    return REGISTRY[method].prefill_mode == PrefillMode.WHOLE_THEN_COMPRESS


def _shares_catalog_prefill(method: str, spec: GeneratorSpec) -> bool:
    """Whether ``method`` can start each request of a catalog group from the group's prefix prefilled
    whole: a whole-prompt method, or a planned one under ``--whole-prefill`` (it reads the prompt whole
    and then drops what its plan does not keep). A method with a scoring pass cannot: the pass would
    read a restored prefix as already chosen (what it holds ranks first), so it reads each prompt itself."""
    from ..methods.registry import REGISTRY, PrefillMode

    m = REGISTRY[method]
    planned = spec.whole_prefill and m.prefill_mode == PrefillMode.PLANNED
    return (_prefills_whole(method) or planned) and not m.scored


def _failed(error: str, t0: float, n_prompt: int = 0) -> GenerationOutput:
    return GenerationOutput("", n_prompt, 0, 0, time.perf_counter() - t0, 0.0, "error", error)


class FullKVGenerator:
    """Constrained greedy decoding with the full llama.cpp KV cache and a token-prefix cache."""

    method = "full"

    def __init__(self, spec: GeneratorSpec) -> None:
        from ..llm import Context, ContextConfig, Model

        self.budget: float | None = None
        self.spec = spec
        self.model = Model(spec.gguf, placement=spec.placement)
        from ..engine.core import kv_type_id

        kv = kv_type_id(spec.kv_type)
        self.ctx = Context(self.model, ContextConfig(n_ctx=spec.n_ctx, n_batch=512, type_k=kv, type_v=kv,
                                                     flash_attn=spec.kv_type != "f16"))
        self._cached: list[int] = []  # tokens whose KV sits in sequence 0 at positions 0..len-1

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "n_ctx": self.spec.n_ctx, "max_tokens": self.spec.max_tokens,
                "reuse_prefix": self.spec.reuse_prefix}

    def _prefill(self, tokens: list[int]) -> int:
        """Make the cache hold exactly ``tokens`` with logits for the last; returns the tokens reused."""
        keep = 0
        if self.spec.reuse_prefix:
            limit = min(len(self._cached), len(tokens) - 1)  # decode at least one token for its logits
            while keep < limit and self._cached[keep] == tokens[keep]:
                keep += 1
        if keep == 0 or not self.ctx.seq_rm(0, keep, -1):
            self.ctx.clear()
            keep = 0
        self._cached = []
        if self.ctx.decode(tokens[keep:], keep, 0, logits="last") != 0:
            self.ctx.clear()
            raise PaskError("llama_decode failed on the prompt")
        self._cached = list(tokens)
        return keep

    def generate(self, case: Case) -> GenerationOutput:
        from ..chat.decoder import Decoder, decode_loop
        from ..engine import EngineConfig

        t0 = time.perf_counter()
        task: Task = make_task(case, self.spec.use_examples)
        try:
            # the same protocol and call bounds as the engine's methods, so Full KV is scored on equal terms
            bounds = EngineConfig()
            p = task_plan(self.model, task, self.spec.prompt_style, bounds.max_string, bounds.max_calls)
        except PaskError as exc:
            return _failed(f"{type(exc).__name__}: {exc}", t0)
        tokens = p.prompt.tokens
        if len(tokens) + self.spec.max_tokens > self.ctx.n_ctx:
            return _failed(f"prompt_too_long: {len(tokens)} + {self.spec.max_tokens} > {self.ctx.n_ctx}", t0,
                           len(tokens))
        decoder = Decoder(self.model, p)
        try:
            reused = self._prefill(tokens)
        except BaseException:
            decoder.close()
            raise
        t_prefill = time.perf_counter() - t0

        def step(tok: int) -> Any:
            if self.ctx.decode([tok], len(self._cached), 0, logits="last") != 0:
                raise PaskError("llama_decode failed during generation")
            self._cached.append(tok)
            return self.ctx.logits()

        out, finish = decode_loop(decoder, self.model, self.ctx.logits(), step, self.spec.max_tokens)
        raw = self.model.detokenize(out, special=True)
        text, extra = checker_text(p, raw, finish, self.spec.max_tokens)
        return GenerationOutput(text, len(tokens), reused, len(out), time.perf_counter() - t0, t_prefill, finish,
                                extra=extra)

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


class EngineGenerator:
    """A KV-budget method (baseline or PASK) run through ``pask_local.engine.Engine``."""

    def __init__(self, method: str, spec: GeneratorSpec) -> None:
        from ..engine import Engine
        from ..llm import Model

        if spec.budget is None:
            raise PaskError(f"method {method!r} needs a KV budget")
        self.method = method
        self.budget = spec.budget
        self.spec = spec
        self.model = Model(spec.gguf, placement=spec.placement)
        self.engine = Engine(self.model, spec.method(method, self.model), spec.engine_config(spec.budget))

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "budget": self.budget, "max_tokens": self.spec.max_tokens}

    def generate(self, case: Case) -> GenerationOutput:
        t0 = time.perf_counter()
        task = make_task(case, self.spec.use_examples)
        try:
            res = self.engine.chat(task.conversation(), task.functions, "required", parallel=task.parallel,
                                   examples=task.examples)
        except PaskError as exc:
            return _failed(f"{type(exc).__name__}: {exc}", t0)
        return _engine_output(res, time.perf_counter() - t0)

    def close(self) -> None:
        self.model.close()


def _engine_output(res: Any, seconds: float) -> GenerationOutput:
    """An engine result as the harness records it (native output handed to the checker as call JSON)."""
    stats = res.stats or {}
    prefill = float(stats.get("prefill_ms", 0.0)) / 1e3
    text = res.text
    extra = {k: v for k, v in stats.items() if _plain(v)}
    if res.prompt.style == "native":
        extra["raw_output"] = res.text
        text = json.dumps(res.parsed, ensure_ascii=False) if res.parsed is not None else res.text
    return GenerationOutput(text, len(res.prompt.tokens), 0, len(res.tokens), seconds, prefill, res.finish, None,
                            extra)


Run = tuple[str, float | None]


class SharedPrefillGenerator:
    """The (method, budget) runs whose methods prefill the whole prompt before compressing (SnapKV,
    PyramidKV, pask-attn, at any budget), answered from one prefill per case (``engine.shared``).

    ``generate_many`` returns one output per run; each run's ``seconds`` is the case's wall time
    divided by the runs that shared it (its ``prefill_seconds`` is the shared prefill's)."""

    def __init__(self, runs: list[Run], spec: GeneratorSpec) -> None:
        from ..engine import Engine
        from ..engine.shared import shares_prefill
        from ..llm import Model

        self.spec = spec
        self.model = Model(spec.gguf, placement=spec.placement)
        self.engines: dict[Run, Any] = {}
        for method, budget in runs:
            if budget is None or method.startswith(ONCE):
                continue
            m = spec.method(method, self.model)
            if shares_prefill(m) and not m.keeps_all:
                self.engines[(method, budget)] = Engine(self.model, m, spec.engine_config(budget))
        self.runs = list(self.engines)

    def view(self, run: Run) -> Any:
        """What the harness's record needs of a generator: its method and budget."""
        return _RunView(*run)

    def generate_many(self, case: Case, runs: list[Run]) -> dict[Run, GenerationOutput]:
        from ..engine.shared import run_shared

        t0 = time.perf_counter()
        task = make_task(case, self.spec.use_examples)
        engines = [self.engines[r] for r in runs]
        try:
            prepared = [e.prepare(task.conversation(), task.functions, "required", task.parallel,
                                  task.examples) for e in engines]
            results = run_shared(engines, prepared)
        except PaskError as exc:
            return {r: _failed(f"{type(exc).__name__}: {exc}", t0) for r in runs}
        share = (time.perf_counter() - t0) / len(runs)
        return {r: _engine_output(res, share) for r, res in zip(runs, results, strict=True)}

    def close(self) -> None:
        self.model.close()


@dataclass(frozen=True)
class _RunView:
    method: str
    budget: float | None


def _plain(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool)) or (isinstance(v, list) and all(isinstance(x, (int, float)) for x in v))
