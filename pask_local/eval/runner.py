"""Drives an evaluation: selects cases, runs every (method, budget) over them, scores, stores.

``run_eval`` loads the cases (bundled categories or ``--dataset``), keeps those of the requested
split, applies the per-category ``limit`` (first N in file order), then for each (method, budget)
generates and scores the cases the result store does not hold yet (``report_only``: none). A
generator is only built when it has work, so a finished run re-reports without generating. A rich progress bar shows the
count, the running accuracy and the ETA.

Before generating, the cases are measured with the model's tokenizer: with ``catalog_tokens`` each
case gets its group's tool catalog (``eval.catalog``); then Full KV's context is sized from the
longest case, and a case too long for the model's trained context is skipped for every method
(``eval.sizing``), so no method is scored on a case another could not run. On a catalog workload a
group's prefix prefilled whole is kept for every run that starts from it (``prefix.whole``).
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ..errors import PaskError
from .catalog import DEFAULT_GROUP_SIZE, apply_catalogs
from .checker import score_output
from .data import CATEGORIES, Case, load_cases
from .fidelity import REF_DIR, FidelityMeter
from .generator import Generator, GeneratorSpec, SharedPrefillGenerator, check_methods, make_generator
from .prompting import make_task, pick_examples, prefix_counter, render_tokens
from .sizing import load_skipped, save_skipped, size_context
from .split import select
from .store import ResultStore, record_key

ERROR_TEXT_LIMIT = 500


@dataclass
class EvalConfig:
    gguf: Path
    out: Path
    methods: list[str] = field(default_factory=lambda: ["full"])
    budgets: list[float] = field(default_factory=lambda: [0.33])
    categories: list[str] | None = None
    limit: int | None = None
    split: str = "eval"
    dataset: Path | None = None
    answers: Path | None = None
    max_tokens: int = 256
    n_ctx: int | None = None    # Full KV's context cap; None: the model's trained context (sized per run: eval.sizing)
    use_examples: bool = True
    prompt_style: str = "auto"
    hysteresis: float = 0.02    # EngineConfig.hysteresis of every method
    compact: bool = True        # EngineConfig.compact of every method
    kv_type: str = "f16"        # EngineConfig.kv_type of every method (and of Full KV)
    share_prefill: bool = True  # compress-after-prefill runs share one prefill per case (engine.shared)
    report_only: bool = False   # rebuild the reports from stored records; generate nothing
    policy: Path | None = None  # a policy file for pask, pask-attn, pask-hybrid, pask-tools (default: the model's)
    fidelity: bool = False      # also teacher-force each method along Full KV's output (eval.fidelity)
    fidelity_refs: Path | None = None  # where Full KV's references live (default: out / REF_DIR); shareable
    catalog_tokens: int | None = None  # each group of cases shares a tool catalog of about this many tokens
    catalog_group: int = DEFAULT_GROUP_SIZE  # cases per catalog group
    catalog_seed: int = 0              # the distractor draw's seed (each group's is derived from it)
    placement: Any = None              # rpc.Placement of every generator's model (--rpc, --ngl); None: PASK_NGL
    whole_prefill: bool = False        # once: runs of a planned method prefill the prefix whole (prefix.build)

    @property
    def ref_dir(self) -> Path:
        return self.fidelity_refs if self.fidelity_refs is not None else self.out / REF_DIR


def parse_budgets(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            b = float(part)
        except ValueError:
            raise PaskError(f"bad budget {part!r}: expected numbers in (0, 1], e.g. 0.33,0.5") from None
        if not 0.0 < b <= 1.0:
            raise PaskError(f"bad budget {part!r}: a KV budget is a fraction in (0, 1]")
        out.append(b)
    if not out:
        raise PaskError("no budget given")
    return list(dict.fromkeys(out))


def runs_of(methods: list[str], budgets: list[float]) -> list[tuple[str, float | None]]:
    """(method, budget) pairs: full once (no budget), every other method at every budget."""
    runs: list[tuple[str, float | None]] = []
    for m in check_methods(methods):
        runs += [(m, None)] if m in ("full", "once:full") else [(m, b) for b in budgets]
    return runs


def selection_line(cfg: EvalConfig, n_loaded: int, n_split: int, n_kept: int) -> str:
    """One line saying how many cases were selected and why (split and limit)."""
    source = f"{cfg.dataset}" if cfg.dataset else "the bundled BFCL categories"
    why = "every case (split all)" if cfg.split == "all" else f"the {cfg.split} split (hashed case ids)"
    line = f"{n_kept} of {n_loaded} cases from {source}: {why}"
    if cfg.split != "all":
        line += f" keeps {n_split}"
    if cfg.limit is not None and n_kept < n_split:
        line += f", --limit {cfg.limit} per category keeps {n_kept}"
    return line


def select_cases(cfg: EvalConfig, report: Callable[[str], None] | None = None) -> list[Case]:
    loaded = load_cases(cfg.categories, cfg.dataset, cfg.answers)
    cases = select(loaded, cfg.split)
    n_split = len(cases)
    if cfg.limit is not None:
        if cfg.limit < 1:
            raise PaskError(f"--limit must be at least 1, got {cfg.limit}")
        seen: dict[str, int] = {}
        kept = []
        for c in cases:
            seen[c.category] = seen.get(c.category, 0) + 1
            if seen[c.category] <= cfg.limit:
                kept.append(c)
        cases = kept
    if not cases:
        raise PaskError(f"no cases in the {cfg.split} split for this selection")
    if report is not None:
        report(selection_line(cfg, len(loaded), n_split, len(cases)))
    return cases


def manifest(cfg: EvalConfig) -> dict[str, Any]:
    try:
        bfcl_version = importlib.metadata.version("bfcl-eval")
    except importlib.metadata.PackageNotFoundError:
        bfcl_version = None
    size = cfg.gguf.stat().st_size if cfg.gguf.is_file() else None
    return {
        "model": str(cfg.gguf), "model_bytes": size, "split": cfg.split,
        "dataset": str(cfg.dataset) if cfg.dataset else None, "max_tokens": cfg.max_tokens,
        "n_ctx": cfg.n_ctx if cfg.n_ctx is not None else "auto", "bfcl_eval": bfcl_version, "prompt_style": cfg.prompt_style,
        "hysteresis": cfg.hysteresis, "compact": cfg.compact, "kv_type": cfg.kv_type,
        "share_prefill": cfg.share_prefill,
        # None (absent in older run.json files) is what they ran: a prefix's plan applied between chunks
        "whole_prefill": True if cfg.whole_prefill else None,
        "examples": [e.id for e in pick_examples()] if cfg.use_examples else [],
        "policy": _policy_id(cfg.policy),
        "catalog": ({"tokens": cfg.catalog_tokens, "group": cfg.catalog_group, "seed": cfg.catalog_seed}
                    if cfg.catalog_tokens is not None else None),
    }


# the manifest entries Full KV's reference of a case depends on (a shared --fidelity-refs checks them)
REFERENCE_KEYS = ("model", "model_bytes", "dataset", "max_tokens", "n_ctx", "bfcl_eval", "prompt_style",
                  "kv_type", "examples", "catalog")


def reference_settings(m: dict[str, Any]) -> dict[str, Any]:
    return {k: m.get(k) for k in REFERENCE_KEYS}


def _policy_id(path: Path | None) -> dict[str, str] | None:
    """What a run's policy file is recorded as: its name and sha256 (None: the models' own)."""
    if path is None:
        return None
    from ..models import file_sha256

    return {"file": path.name, "sha256": file_sha256(path)}


def _record(case: Case, gen: Generator, out: Any) -> dict[str, Any]:
    if out.error:
        valid, error_type, errors = False, "generation_error", [out.error]
    else:
        score = score_output(case, out.text)
        valid, error_type, errors = score.valid, score.error_type, score.errors
    return {
        "id": case.id, "category": case.category, "method": gen.method, "budget": gen.budget,
        "output": out.text, "valid": valid, "error_type": error_type,
        "error": str(errors)[:ERROR_TEXT_LIMIT] if errors else None,
        "finish": out.finish, "n_prompt": out.n_prompt, "n_reused": out.n_reused,
        "n_generated": out.n_generated, "seconds": round(out.seconds, 4),
        "prefill_seconds": round(out.prefill_seconds, 4),
        **({"stats": out.extra} if out.extra else {}),
        **({"catalog": case.meta} if case.meta else {}),
    }


def _done(store: ResultStore, case: Case, run: tuple[str, float | None], fidelity: bool) -> bool:
    """A stored record counts as done; with ``fidelity`` only when it holds the fidelity field too."""
    rec = store.records.get(record_key(case.id, *run))
    return rec is not None and (not fidelity or "fidelity" in rec)


GeneratorFactory = Callable[[str, GeneratorSpec], Generator]


def _spec(cfg: EvalConfig, budget: float | None, n_ctx: int, whole_prefills: Any = None) -> GeneratorSpec:
    return GeneratorSpec(cfg.gguf, budget, cfg.max_tokens, n_ctx, use_examples=cfg.use_examples,
                         prompt_style=cfg.prompt_style, hysteresis=cfg.hysteresis, compact=cfg.compact,
                         kv_type=cfg.kv_type, policy=cfg.policy, shared_catalog=cfg.catalog_tokens is not None,
                         placement=cfg.placement, whole_prefill=cfg.whole_prefill, whole_prefills=whole_prefills)


def _share_across_methods(cfg: EvalConfig, cases: list[Case], pending: dict) -> bool:
    """One prefill per case for the pending whole-prompt runs (``_run_shared``), unless a catalog
    workload makes one prefill per (run, group) cheaper (``eval.prefix_once.SharedCatalogGenerator``)."""
    from .generator import _prefills_whole

    runs = [r for r in pending if pending[r] and r[1] is not None and not r[0].startswith("once:")]
    if len(runs) < 2:
        return False
    if cfg.catalog_tokens is None:
        return True
    whole = [r for r in runs if _prefills_whole(r[0])]
    groups = {(c.meta or {}).get("group", c.id) for c in cases}
    return len(whole) * len(groups) >= len(cases)


def _split_pool(cfg: EvalConfig) -> list[Case]:
    """Every case of the run's split, whatever ``--categories`` and ``--limit`` keep: the groups
    and the distractors of a catalog come from here, so they do not change with the selection."""
    loaded = load_cases(None, cfg.dataset, cfg.answers) if cfg.dataset else load_cases(list(CATEGORIES))
    return select(loaded, cfg.split)


def prepare_cases(cfg: EvalConfig, cases: list[Case], report: Callable[[str], None]) -> tuple[list[Case], int]:
    """(the cases every method runs, Full KV's context): catalogs applied, cases that fit none
    skipped (saved in the output directory, one line each reported)."""
    from ..llm import Model

    model = Model(cfg.gguf)
    try:
        limit = min(cfg.n_ctx or model.n_ctx_train, model.n_ctx_train)
        if cfg.catalog_tokens is not None:
            count = prefix_counter(model, cfg.prompt_style, cfg.use_examples)
            cases = apply_catalogs(cases, _split_pool(cfg), cfg.catalog_tokens, count, cfg.catalog_group,
                                   cfg.catalog_seed, n_ctx_train=limit)
        lengths = {c.id: len(render_tokens(model, make_task(c, cfg.use_examples), cfg.prompt_style)) for c in cases}
    finally:
        model.close()
    n_ctx, skipped = size_context(lengths, cfg.max_tokens, limit)
    if skipped:
        cfg.out.mkdir(parents=True, exist_ok=True)
        save_skipped(cfg.out, skipped)
    for s in skipped:
        report(s.line())
    gone = {s.id for s in skipped}
    return [c for c in cases if c.id not in gone], n_ctx


def _run_shared(cfg: EvalConfig, cases: list[Case], pending: dict, store: ResultStore, progress: Any,
                task: Any, n_ctx: int) -> None:
    """The pending runs that can share a prefill, case by case; their pending lists are emptied."""
    gen = SharedPrefillGenerator([r for r in pending if pending[r]], _spec(cfg, None, n_ctx))
    try:
        if len(gen.runs) < 2:
            return
        todo = {r: {c.id for c in pending[r]} for r in gen.runs}
        n_ok = n = 0
        for case in cases:
            runs = [r for r in gen.runs if case.id in todo[r]]
            if not runs:
                continue
            for run, out in gen.generate_many(case, runs).items():
                rec = _record(case, gen.view(run), out)
                store.add(rec)
                n += 1
                n_ok += rec["valid"]
                progress.update(task, advance=1, description=f"shared prefill x{len(runs)} acc {n_ok}/{n}")
        for r in gen.runs:
            pending[r] = []
    finally:
        gen.close()


def run_eval(cfg: EvalConfig, console: Console | None = None,
             factory: GeneratorFactory = make_generator) -> tuple[ResultStore, list[Case], list[tuple[str, float | None]]]:
    """Generate and score every pending (case, method, budget); returns the store, cases and runs."""
    runs = runs_of(cfg.methods, cfg.budgets)
    console = console or Console(stderr=True)

    def say(line: str) -> None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    selection: list[str] = []  # said once the cases are prepared: a bad --catalog-tokens stays one line
    cases = select_cases(cfg, selection.append)
    n_ctx = cfg.n_ctx or 0
    if cfg.report_only:
        skipped = {s.id for s in load_skipped(cfg.out)}  # too long for the model: no method ran them
        cases = [c for c in cases if c.id not in skipped]
    else:
        # before the store pins the settings: a catalog that cannot be built leaves no run.json behind
        cases, n_ctx = prepare_cases(cfg, cases, selection.append)
        selection.append(f"Full KV context: {n_ctx} tokens (the longest case + max_tokens)")
    run_manifest = manifest(cfg)
    store = ResultStore(cfg.out, run_manifest)
    if cfg.catalog_tokens is not None and not cfg.report_only:
        store.note_cases("catalog_cases", {c.id: c.meta for c in cases if c.meta})
    for line in selection:
        say(line)
    pending = {run: [] if cfg.report_only else [c for c in cases if not _done(store, c, run, cfg.fidelity)]
               for run in runs}
    meter = (FidelityMeter(cfg.ref_dir, cfg.use_examples, reference_settings(run_manifest))
             if cfg.fidelity and not cfg.report_only else None)
    total = sum(len(v) for v in pending.values())
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console, disable=total == 0) as progress:
        task = progress.add_task("eval", total=total)
        if cfg.share_prefill and meter is None and _share_across_methods(cfg, cases, pending):
            _run_shared(cfg, cases, pending, store, progress, task, n_ctx)
        # a catalog group's prefix prefilled whole, once for every run that starts from it (prefix.whole)
        from ..prefix.whole import WholePrefills

        whole_prefills = WholePrefills() if cfg.catalog_tokens is not None and cfg.share_prefill else None
        for (method, budget), todo in pending.items():
            if not todo:
                continue
            gen = factory(method, _spec(cfg, budget, n_ctx, whole_prefills))
            label = method if budget is None else f"{method}@{budget:g}"
            n_ok = n = 0
            try:
                for case in todo:
                    rec = _record(case, gen, gen.generate(case))
                    if meter is not None:
                        t = time.perf_counter()
                        raw = (rec.get("stats") or {}).get("raw_output", rec["output"])
                        rec["fidelity"] = meter.measure(case, gen, raw)
                        rec["fidelity_seconds"] = round(time.perf_counter() - t, 4)
                    store.add(rec)
                    n += 1
                    n_ok += rec["valid"]
                    progress.update(task, advance=1, description=f"{label} acc {n_ok}/{n}")
            finally:
                gen.close()
    if meter is not None and (meter.refs.computed or meter.refs.loaded):
        console.print(f"Full KV references: {meter.refs.computed} computed, {meter.refs.loaded} reused "
                      f"({meter.refs.dir})", markup=False, highlight=False, soft_wrap=True)
    return store, cases, runs
