"""Compress once: a prompt prefix (system + tools, up to the user's turn) compressed on its own.

``find_prefix`` renders the request as the engine does with different user texts and tool choices
and keeps the tokens they all share: what every request with these tools and system prompt starts
with. ``prefill_prefix`` prefills that prefix alone in a one-slot pool under the engine's method and
saves the stream (``prefix.state``); ``compress`` does it for a query-agnostic method (the kept
entries cannot depend on a question that is not there) and adds a header naming everything the
state depends on (``prefix.file``). ``open_file`` checks a file against the model; ``pin`` against
the method, budget, K/V type, tools and head it is used with, and returns a ``Pinned`` prefix for a
pool (``engine.prefix_cache``): restored into a request's stream, checked against the positions the
header lists, then the request's own prompt continues from it (``run_from_prefix``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.core import Engine, Prepared, holds_whole_prompt
from ..engine.pool import Pinned, SlotPool, slot_keep
from ..errors import PaskError
from ..grammar.sampling import GREEDY
from ..llm import Context, Model
from ..methods import PrefillMode
from ..methods.registry import REGISTRY
from ..models import file_sha256
from ..schema.tools import ToolSpec
from ..tagging.prompt import Prompt
from . import state as kv_state
from .file import PrefixFileError, PrefixHeader, read, sha256_json, sha256_text, write

_USER_TEXTS = ("A", "Which one? 7")  # two questions that share no first token


def tools_digest(tools: list[ToolSpec]) -> str:
    """sha256 of the tools as the prompt shows them (name, description, parameters)."""
    return sha256_json([[t.name, t.description, t.parameters] for t in tools])


def template_digest(model: Model) -> str:
    return sha256_text(model.chat_template() or "")


Head = list[Any]  # the messages before the user's turn (a system prompt, earlier turns): dicts or Messages
Examples = list[tuple[str, str]] | None  # the few-shot examples a prompt may carry (``Engine.prepare``)


def head_of(system: str | None) -> Head:
    """The head of a request whose only message before the user's is ``system`` (or none)."""
    return [{"role": "system", "content": system}] if system else []


def head_digest(head: Head) -> str:
    return sha256_json([m if isinstance(m, dict) else dataclasses.asdict(m) for m in head])


def _with_user(head: Head, user: str) -> Head:
    return [*head, {"role": "user", "content": user}]


def find_prefix(engine: Engine, tools: list[ToolSpec], head: Head, examples: Examples = None,
                parallel: bool = False) -> Prompt:
    """The tokens (with their classes) every request with these tools, head and examples starts with,
    whatever its question and tool choice (the instruction prompt's header says whether a list of
    calls is allowed: ``parallel`` must be the requests')."""
    prompts = [engine.prepare(_with_user(head, u), tools, choice, parallel=parallel, examples=examples).plan.prompt
               for u in _USER_TEXTS for choice in ("auto", "required")]
    first = prompts[0]
    n = len(first.tokens)
    for p in prompts[1:]:
        n = min(n, next((i for i, (a, b) in enumerate(zip(first.tokens, p.tokens, strict=False)) if a != b),
                        min(len(first.tokens), len(p.tokens))))
    if n < 2:
        raise PaskError("the prompt has no prefix shared by every request (nothing to compress)")
    return Prompt(spans=[], tokens=list(first.tokens[:n]), classes=list(first.classes[:n]), style=first.style)


def check_query_agnostic(method: str) -> None:
    """One line unless ``method`` decides without the question (``methods.registry``)."""
    entry = REGISTRY.get(method)
    if entry is None or entry.query_aware:
        why = f" ({entry.why})" if entry else ""
        raise PaskError(f"method '{method}' is query-aware{why}: a prefix compressed without the question "
                        f"needs a query-agnostic method (see `pask-local methods`)")


@dataclass
class Compressed:
    header: PrefixHeader
    state: bytes
    prefill_s: float      # prefill + compression of the prefix
    held: int             # K/V entries kept (all layers)
    full: int             # entries Full KV holds for the prefix (all layers)


def prefill_prefix(engine: Engine, tools: list[ToolSpec], head: Head, examples: Examples = None,
                   parallel: bool = False, whole: bool = False,
                   start: Pinned | None = None) -> tuple[Prompt, bytes, list[list[int]], float, str]:
    """The prefix alone, prefilled (and compressed) by ``engine``'s method at its budget in a one-slot
    pool: (the prefix, its saved state, the positions kept per layer, seconds, the state's kind).
    ``whole``: a planned method prefills the prefix whole and then drops what its plan does not keep
    (``EngineConfig.plan_after_prefill``), instead of dropping it between chunks. ``start``: the
    prefix already prefilled whole (``prefix.whole``, for ``engine``'s method and budget), restored
    first, so that only what it lacks is decoded."""
    method, model, cfg = engine.method, engine.model, engine.cfg
    prefix = find_prefix(engine, tools, head, examples, parallel)
    n = len(prefix.tokens)
    base = engine.prepare(_with_user(head, _USER_TEXTS[0]), tools, "auto", parallel=parallel, examples=examples)
    prepared = Prepared(dataclasses.replace(base.plan, prompt=prefix), "", n + 1, GREEDY)
    solo = Engine(model, method, dataclasses.replace(cfg, max_tokens=0, plan_after_prefill=whole))
    pool = SlotPool(model, SlotPool.layout_for(model, method, cfg.budget, _slot_len(solo, n + 1, n + 1), slots=1,
                                               kv_type=cfg.kv_type), flash_attn=cfg.flash_attn)
    try:
        t0 = time.perf_counter()
        if start is not None:
            pool.pin(start)
        pool.execute(solo, prepared)
        seconds = time.perf_counter() - t0
        if pool.cache.held(0) is None:
            raise PaskError("the compressed prefix was not kept (prefix cache off?)")
        return prefix, kv_state.save(pool.ctx, 0), _positions(pool.ctx, 0, n, model.n_layer), seconds, \
            kv_state.kind_of(pool.ctx)
    finally:
        pool.close()


def compress(engine: Engine, tools: list[ToolSpec], head: Head, policy_sha256: str | None = None,
             extra: dict[str, Any] | None = None, examples: Examples = None, parallel: bool = False,
             whole: bool = False, start: Pinned | None = None) -> Compressed:
    """Prefill the prefix alone and compress it with ``engine``'s (query-agnostic) method at its budget
    (``whole``, ``start``: as ``prefill_prefix``)."""
    method, model, cfg = engine.method, engine.model, engine.cfg
    check_query_agnostic(method.name)
    prefix, blob, kept, seconds, kind = prefill_prefix(engine, tools, head, examples, parallel, whole, start)
    n = len(prefix.tokens)
    header = PrefixHeader(
        model_sha256=file_sha256(Path(model.path)), model_name=Path(model.path).name, n_layer=model.n_layer,
        upstream=_upstream(), template_sha256=template_digest(model), style=prefix.style,
        tools_sha256=tools_digest(tools), system_sha256=head_digest(head), method=method.name,
        budget=None if method.keeps_all else cfg.budget, policy_sha256=policy_sha256, kv_type=cfg.kv_type,
        tokens=list(prefix.tokens), classes=[c.value for c in prefix.classes], kept=kept,
        state_kind=kind, extra={**(extra or {}), **({"prefill": "whole" if whole else "reading"}
                                                    if method.prefill_mode == PrefillMode.PLANNED else {})})
    return Compressed(header, blob, seconds, header.held(), n * model.n_layer)


def save(path: Path, compressed: Compressed) -> int:
    return write(path, compressed.header, compressed.state)


def _positions(ctx: Context, seq: int, n: int, n_layer: int) -> list[list[int]]:
    if kv_state.kind_of(ctx) == "layered":
        return [sorted(ctx.positions(il, seq)) for il in range(n_layer)]  # type: ignore[attr-defined]
    return [list(range(n)) for _ in range(n_layer)]  # upstream's cache keeps every position


def _upstream() -> str:
    import llama_cpp

    return str(llama_cpp.__version__)


def max_state_bytes(model: Model, n_tokens: int) -> int:
    """The most K/V state bytes ``n_tokens`` positions can take in ``model`` (f32 K and V rows, cell
    metadata): the bound a prefix file's size is checked against before it is read."""
    n_embd = int(model.meta(f"{model.arch}.embedding_length") or 0) or 8192
    return n_tokens * model.n_layer * (8 * n_embd + 64) + model.n_layer * 256 + 4096


def open_file(path: Path, model: Model) -> tuple[PrefixHeader, bytes]:
    """Read a prefix file and check it against ``model`` (its build, template and weights)."""
    name = path.name
    header, blob = read(path, max_state_bytes(model, model.n_ctx_train))
    if header.n_layer != model.n_layer or header.upstream != _upstream():
        raise PrefixFileError(f"prefix file {name} was made for another model or llama.cpp build "
                              f"({header.model_name}, llama-cpp-python {header.upstream})")
    if header.template_sha256 != template_digest(model):
        raise PrefixFileError(f"prefix file {name} was made with another chat template")
    if header.model_sha256 != file_sha256(Path(model.path)):
        raise PrefixFileError(f"prefix file {name} was made for another model ({header.model_name})")
    return header, blob


def pin(path: Path | str, header: PrefixHeader, blob: bytes, model: Model, method: str, budget: float | None,
        kv_type: str, tools: list[ToolSpec] | None = None, head: Head | None = None) -> Pinned:
    """Check an opened file against what it will be used with; a ``Pinned`` prefix for a pool.
    ``budget``: None for Full KV. ``tools``/``head``: the request's (None: not known here; the pool
    matches each prompt's tokens)."""
    name = Path(path).name
    if tools is not None and header.tools_sha256 != tools_digest(tools):
        raise PrefixFileError(f"prefix file {name} was made for another tool list")
    if head is not None and header.system_sha256 != head_digest(head):
        raise PrefixFileError(f"prefix file {name} was made with another system prompt")
    if header.method != method or header.budget != budget:
        at = "" if header.budget is None else f" at budget {header.budget}"
        raise PrefixFileError(f"prefix file {name} holds '{header.method}'{at}; this run asks for '{method}'"
                              + ("" if budget is None else f" at budget {budget}"))
    if header.kv_type != kv_type:
        raise PrefixFileError(f"prefix file {name} holds a {header.kv_type} K/V cache, this run a {kv_type} one")
    kept = [sorted(k) for k in header.kept]

    def restore(ctx: Any, seq: int) -> None:
        try:
            kv_state.restore(ctx, seq, blob)
        except PaskError as exc:
            raise PrefixFileError(f"prefix file {name}: {exc}") from None
        if kv_state.kind_of(ctx) == "layered" and any(
                sorted(ctx.positions(il, seq)) != kept[il] for il in range(model.n_layer)):
            ctx.seq_rm(seq, -1, -1)
            raise PrefixFileError(f"prefix file {name}: its K/V does not match the positions its header lists")

    return Pinned(tuple(header.tokens), header.method, header.budget, restore)


def run_from_prefix(engine: Engine, prepared: Prepared, pinned: Pinned, trace: str | Path | None = None,
                    on_token: Any = None) -> Any:
    """Run one prepared request whose prompt starts with ``pinned``'s prefix: a one-slot pool
    restores the prefix and prefills only the rest (``EngineResult``)."""
    cfg = engine.cfg
    slot_len = _slot_len(engine, prepared.n_prompt, prepared.n_prompt + cfg.max_tokens)
    pool = SlotPool(engine.model, SlotPool.layout_for(engine.model, engine.method, cfg.budget, slot_len, slots=1,
                                                      kv_type=cfg.kv_type), flash_attn=cfg.flash_attn)
    try:
        pool.pin(pinned)
        return pool.submit(engine, prepared, on_token, trace=trace).result()
    finally:
        pool.close()


def _slot_len(engine: Engine, n_prompt: int, n_seq: int) -> int:
    """A one-slot pool's length for ``n_seq`` positions (a whole-prompt method's slot holds the whole
    prompt before it compresses, in its smallest layer too: ``pool.slot_keep``)."""
    if holds_whole_prompt(engine.method, engine.cfg):
        keep = slot_keep(engine.model, engine.method, engine.cfg.budget)
        return max(n_seq, math.ceil((n_prompt + 1) / min(keep)))
    return n_seq


def check_prompt(prefix: Sequence[int], prompt_tokens: Sequence[int], name: str) -> None:
    """One line unless the request's prompt starts with the ``prefix`` tokens (of ``name``) and goes on past it."""
    n = len(prefix)
    if len(prompt_tokens) <= n or list(prompt_tokens[:n]) != list(prefix):
        raise PrefixFileError(f"the prompt does not start with the prefix in {name} (another system prompt, tool "
                              f"list or prompt style)")
