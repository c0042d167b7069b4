"""``pask-local calibrate``: measure the calibration signals on BFCL's calib split and write a policy.

Cases come from the calibration split only (``eval.split``), taken round-robin over the requested
categories, each category in a fixed hash order (``sha256("pask-calib-order-v1:" + id)``), so a run
with ``--cases N`` is a deterministic prefix of a run with more cases. Every measured (or skipped)
case is appended as one JSON line to the cache (default: ``<out>.cases.jsonl``); a rerun with the
same model and settings skips the cases already there, so an interrupted run resumes. The policy is
then fitted from all cached cases of the selection (``policy_fit``).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from pask_local.cli_options import ModelOption
from pask_local.errors import PaskError
from pask_local.policy.schema import Policy, contiguous_groups

from .policy_fit import FitRule, fit_policy, summary_rows

ORDER_SALT = "pask-calib-order-v1:"
CACHE_VERSION = 1


class CalibrationError(PaskError):
    """Bad input to ``pask-local calibrate`` or an unusable measurement cache."""


def _order_key(case_id: str) -> str:
    return hashlib.sha256((ORDER_SALT + case_id).encode()).hexdigest()


def calib_cases(categories: list[str] | None) -> list:
    """All calibration-split cases of ``categories``, interleaved round-robin in hash order."""
    from pask_local.eval.data import CATEGORIES, canonical_category, load_bundled
    from pask_local.eval.split import select

    names = [n for c in (categories or list(CATEGORIES)) for n in c.split(",") if n.strip()]
    cats = list(dict.fromkeys(canonical_category(c) for c in (names or list(CATEGORIES))))
    pools = [sorted(select(load_bundled(c), "calib"), key=lambda x: _order_key(x.id)) for c in cats]
    out = []
    for i in range(max((len(p) for p in pools), default=0)):
        out += [p[i] for p in pools if i < len(p)]
    return out


def catalog_pool(model: Any, pool: list, n: int, target: int, style: str, use_examples: bool) -> list:
    """The first ``n`` cases of ``pool``, each behind its group's catalog of about ``target`` tokens,
    grouped and built as ``eval --catalog-tokens`` builds them, from the whole calib split."""
    from pask_local.eval.catalog import apply_catalogs
    from pask_local.eval.data import CATEGORIES, load_bundled
    from pask_local.eval.prompting import prefix_counter
    from pask_local.eval.split import select

    split = [c for cat in CATEGORIES for c in select(load_bundled(cat), "calib")]
    count = prefix_counter(model, style, use_examples)
    return apply_catalogs(pool[:n], split, target, count, n_ctx_train=model.n_ctx_train)


def _settings(model_sha: str, groups: list[list[int]], chunk: int, dtype: str, use_examples: bool,
              style: str = "plain", signal: str = "reference", keep: float = 0.0) -> dict[str, Any]:
    out = {"cache_version": CACHE_VERSION, "model_sha256": model_sha, "groups": groups, "chunk": chunk,
           "dtype": dtype, "examples": use_examples}
    if style != "plain":  # caches written before the native protocol are plain ones
        out["prompt_style"] = style
    if signal != "reference":  # caches written before the native signal are reference ones
        out.update(signal=signal, keep=keep)
        del out["chunk"], out["dtype"]  # one prefill chunk, llama.cpp's own numerics
    return out


def read_cache(path: Path, settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """id -> record of a cache file written with ``settings`` (CalibrationError on a mismatch)."""
    records: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return records
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(path.read_text().splitlines()):
                continue          # a line cut short by an interrupted run: measured again
            raise CalibrationError(f"{path}:{lineno}: not a calibration cache line") from None
        if not isinstance(rec, dict) or "id" not in rec or "settings" not in rec:
            raise CalibrationError(f"{path}:{lineno}: not a calibration cache line")
        if rec["settings"] != settings:
            raise CalibrationError(
                f"{path} was measured with other settings (model, groups, chunk, dtype or examples); "
                "pass another --cache or delete it")
        records[rec["id"]] = rec
    return records


def _append(cache: Path, rec: dict[str, Any]) -> None:
    """One cache line (a later line for the same case id replaces an earlier one on reading)."""
    with cache.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def _ticker(progress: Any, task: Any, case_id: str, total: int):
    state = {"n": 0}

    def tick() -> None:
        state["n"] += 1
        progress.update(task, description=f"{case_id} cell {state['n']}/{total}")

    return tick


def calibrate_command(
    gguf: Annotated[Path | None, typer.Option("--gguf", help="GGUF model (default: the embedded Gemma 3 270M)")] = None,
    categories: Annotated[list[str] | None, typer.Option(
        "--categories", help="BFCL categories, comma-separated or repeated (default: all 8)")] = None,
    cases: Annotated[int, typer.Option("--cases", help="calib cases to measure (round-robin over categories)")] = 64,
    out: Annotated[Path, typer.Option("--out", help="policy JSON to write")] = Path("policy.json"),
    groups: Annotated[int, typer.Option("--groups", help="contiguous layer groups")] = 4,
    *,
    model: ModelOption = None,
    chunk: Annotated[int, typer.Option("--chunk", help="the engine's prefill chunk")] = 64,
    cache: Annotated[Path | None, typer.Option("--cache", help="measurement cache (default: <out>.cases.jsonl)")] = None,
    threads: Annotated[int, typer.Option("--threads", help="torch threads")] = 1,
    dtype: Annotated[str, typer.Option("--dtype", help="reference compute: float32 | bfloat16")] = "float32",
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="skip cases longer than this")] = 2048,
    max_minutes: Annotated[float, typer.Option("--max-minutes", help="stop measuring after this (0: no limit)")] = 0.0,
    use_examples: Annotated[bool, typer.Option("--examples/--no-examples", help="few-shot examples as in eval")] = True,
    prompt_style: Annotated[str, typer.Option("--prompt-style", help="the prompt the cases are measured on, as "
                                              "in eval: native (the model's own tool protocol), plain (the "
                                              "instruction prompt) or auto (native when the template has it)")] = "auto",
    tau_hi: Annotated[float, typer.Option("--tau-hi", help="dNLL (nats/token) for a full floor")] = FitRule.tau_hi,
    tau_lo: Annotated[float, typer.Option("--tau-lo", help="dNLL for a half floor")] = FitRule.tau_lo,
    floor_cap: Annotated[float, typer.Option("--floor-cap", help="max expected KV share of floors")] = FitRule.floor_cap,
    min_weight: Annotated[float, typer.Option("--min-weight", help="smallest residual weight")] = FitRule.min_weight,
    signal: Annotated[str, typer.Option("--signal", help="reference: the torch reference, the engine's chunked "
                                        "prefill (slow: a forward per cell); native: llama.cpp itself, one prefill "
                                        "per case, the eviction seen by the continuation only, as a method that "
                                        "compresses after reading the prompt (calibration/native_signals.py)")] = "reference",
    keep: Annotated[float, typer.Option("--keep", help="native signal: the share of each span of a class kept "
                                        "when it is evicted (the budget-aware signal; 0: the whole class)")] = 0.0,
    group_curves: Annotated[bool, typer.Option("--group-curves", help="native signal: also measure, per layer "
                                               "group, the NLL increase when that group alone keeps 5-50% of the "
                                               "prompt, and split every budget between the groups by these curves "
                                               "(pask_local/policy/groups.py)")] = False,
    group_min_share: Annotated[float, typer.Option("--group-min-share", help="with --group-curves: no group "
                                                   "keeps less than this fraction of the budget (the groups are "
                                                   "measured one at a time; their errors do not simply add up)")
                               ] = 0.5,
    catalog_tokens: Annotated[int, typer.Option("--catalog-tokens", help="measure on the catalog workload, as "
                                                "`eval --catalog-tokens`: each case behind its group's catalog "
                                                "of about this many tokens, built from the calib split (0: the "
                                                "cases' own tools); raise --max-tokens above it")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", help="no progress or tables")] = False,
) -> Policy:
    """Measure calibration signals on BFCL's calib split and write a calibrated policy (resumable).

    Up to ``cases`` calib cases are measured (resuming from the cache), the policy is fitted
    (floors from dNLL by tau_hi/tau_lo under floor_cap, weights from distortion) and saved to ``out``.
    max_minutes: stop measuring new cases after this much time and fit what is cached.
    """
    rule = FitRule(tau_hi=tau_hi, tau_lo=tau_lo, floor_cap=floor_cap, min_weight=min_weight)
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from pask_local.chat.protocol import resolve_style
    from pask_local.eval.prompting import ENGINE_STYLES
    from pask_local.llm import Model
    from pask_local.models import file_sha256, resolve_model

    from .cases import CaseSkipped, build_case
    from .native_signals import GROUP_LEVELS, measure_case_native, measure_group_curves, n_native_cells
    from .reference import ReferenceModel
    from .signals import measure_case, measure_joint, n_cells, n_joint_cells

    console = Console(stderr=True, quiet=quiet)
    if cases <= 0:
        raise CalibrationError("--cases must be a positive number")
    if groups <= 0:
        raise CalibrationError("--groups must be a positive number")
    if chunk <= 0:
        raise CalibrationError("--chunk must be a positive number")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise CalibrationError(f"--dtype must be one of {', '.join(dtypes)}")
    if out.suffix != ".json":
        raise CalibrationError(f"--out must name a .json policy file, got {out}")
    if out.parent and not out.parent.exists():
        raise CalibrationError(f"output directory does not exist: {out.parent}")
    rule.check()
    if signal not in ("reference", "native"):
        raise CalibrationError(f"--signal must be reference or native, got {signal!r}")
    if not 0.0 <= keep < 1.0:
        raise CalibrationError(f"--keep must be in [0, 1), got {keep}")
    if keep and signal != "native":
        raise CalibrationError("--keep needs --signal native")
    if group_curves and signal != "native":
        raise CalibrationError("--group-curves needs --signal native")
    if not 0 <= group_min_share <= 1:
        raise CalibrationError(f"--group-min-share must be in [0, 1], got {group_min_share:g}")
    if catalog_tokens < 0:
        raise CalibrationError(f"--catalog-tokens must be 0 or positive, got {catalog_tokens}")
    if catalog_tokens and catalog_tokens >= max_tokens:
        raise CalibrationError(f"--catalog-tokens {catalog_tokens} needs --max-tokens above it (cases longer "
                               f"than --max-tokens are skipped), got {max_tokens}")
    if prompt_style not in ENGINE_STYLES:
        raise CalibrationError(f"unknown --prompt-style '{prompt_style}' ({', '.join(ENGINE_STYLES)})")
    path = resolve_model(gguf, model)
    pool = calib_cases(categories)
    if not pool:
        raise CalibrationError("no calibration cases in the selected categories")
    cache = cache or out.with_suffix(".cases.jsonl")
    torch.set_num_threads(max(1, threads))

    model = Model(path)
    style = "native" if resolve_style(model, ENGINE_STYLES[prompt_style])[1] is not None else "plain"
    sha = file_sha256(path)
    layer_groups = contiguous_groups(model.n_layer, groups)
    settings = _settings(sha, layer_groups, chunk, dtype, use_examples, style, signal, keep)
    if catalog_tokens:
        settings["catalog_tokens"] = catalog_tokens
        pool = catalog_pool(model, pool, cases, catalog_tokens, style, use_examples)
    done = read_cache(cache, settings)
    measured = [c for c in pool if c.id in done and "cells" in done[c.id]]
    t0 = time.monotonic()
    ref: ReferenceModel | None = None
    want = min(cases, len(pool))
    with Progress(TextColumn("[bold]calibrate"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task("", total=want, completed=min(len(measured), want))
        for case in pool:
            n_have = sum(1 for c in pool if c.id in done and "cells" in done[c.id])
            if n_have >= want:
                break
            if case.id in done:
                continue
            if max_minutes and time.monotonic() - t0 > max_minutes * 60:
                console.print(f"[yellow]time limit of {max_minutes:g} min reached: fitting {n_have} case(s)")
                break
            rec: dict[str, Any] = {"id": case.id, "category": case.category, "settings": settings}
            try:
                tc = build_case(model, case, use_examples=use_examples, max_tokens=max_tokens, style=style)
            except CaseSkipped as exc:
                rec["skipped"] = str(exc)
            else:
                progress.update(task, description=f"{case.id} ({len(tc.tokens)} tokens)")
                if signal == "native":
                    tick = _ticker(progress, task, case.id, n_native_cells(tc, len(layer_groups)))
                    rec.update(measure_case_native(model, tc, layer_groups, keep, on_cell=tick))
                else:
                    if ref is None:
                        progress.update(task, description="loading the torch reference")
                        ref = ReferenceModel.from_gguf(path, dtype=dtypes[dtype], device="cpu")
                    sig = measure_case(ref, tc, layer_groups, chunk=chunk,
                                       on_cell=_ticker(progress, task, case.id, n_cells(tc, len(layer_groups))))
                    rec.update(sig.to_json())
                progress.advance(task)
            _append(cache, rec)
            done[case.id] = rec
        # cases cached before joint measurements existed: add them (the per-group cells are kept)
        old = [c for c in pool if c.id in done and "cells" in done[c.id] and "joint" not in done[c.id]][:want]
        if old:
            progress.update(task, description=f"joint cells for {len(old)} cached case(s)")
        for case in old:
            if ref is None:
                ref = ReferenceModel.from_gguf(path, dtype=dtypes[dtype], device="cpu")
            tc = build_case(model, case, use_examples=use_examples, max_tokens=max_tokens, style=style)
            tick = _ticker(progress, task, case.id, n_joint_cells(tc))
            rec = {**done[case.id], "joint": measure_joint(ref, tc, chunk=chunk, on_cell=tick)}
            _append(cache, rec)
            done[case.id] = rec
        # group budget curves for the cases that lack them (a cheap pass over the same prefills)
        if group_curves:
            lacking = [c for c in pool if c.id in done and "cells" in done[c.id]
                       and "group_curves" not in done[c.id]][:want]
            for case in lacking:
                if max_minutes and time.monotonic() - t0 > max_minutes * 60:
                    console.print("[yellow]time limit reached: fitting the group curves measured so far")
                    break
                tc = build_case(model, case, use_examples=use_examples, max_tokens=max_tokens, style=style)
                progress.update(task, description=f"group curves {case.id}")
                rec = {**done[case.id], "group_curves": measure_group_curves(model, tc, layer_groups, GROUP_LEVELS)}
                _append(cache, rec)
                done[case.id] = rec
    records = [done[c.id] for c in pool if c.id in done and "cells" in done[c.id]][:want]
    if not records:
        raise CalibrationError("no case could be measured (all skipped); see the cache for the reasons")
    provenance = {
        "model_file": path.name, "model_sha256": sha, "arch": model.arch, "n_layer": model.n_layer,
        "data": "BFCL v4 (bfcl-eval)", "split": "calib",
        "categories": sorted({r["category"] for r in records}),
        "n_cases": len(records),
        "cases_per_category": {cat: sum(1 for r in records if r["category"] == cat)
                               for cat in sorted({r["category"] for r in records})},
        "n_skipped": sum(1 for c in pool if c.id in done and "skipped" in done[c.id]),
        "date": _dt.date.today().isoformat(),
        "chunk": chunk, "reference_dtype": dtype, "few_shot_examples": use_examples, "max_tokens": max_tokens,
        "prompt_style": style,
        "command": (f"pask-local calibrate --gguf {path.name} --categories {','.join(dict.fromkeys(c.category for c in pool))} "
                    f"--cases {cases} --groups {groups} --max-tokens {max_tokens} --prompt-style {style}"
                    + (f" --signal native --keep {keep:g}" if signal == "native" else "")
                    + (f" --group-curves --group-min-share {group_min_share:g}" if group_curves else "")
                    + (f" --catalog-tokens {catalog_tokens}" if catalog_tokens else "")),
    }
    if signal == "native":
        provenance.update(signal="native (llama.cpp, one prefill per case; calibration/native_signals.py)",
                          keep=keep)
        del provenance["chunk"], provenance["reference_dtype"]
    policy = fit_policy(records, layer_groups, rule, provenance, group_curves=group_curves,
                        group_min_share=group_min_share)
    policy.save(out)
    measured, fitted = summary_rows(policy)
    per_token = "dNLL per evicted token" if signal == "native" else "distortion per evicted token"
    for title, rows in ((f"measured on {len(records)} calib case(s): dNLL (nats/token) / {per_token}", measured),
                        ("policy: floor / weight", fitted)):
        table = Table(title=title)
        table.add_column("class")
        for g, layers in enumerate(layer_groups):
            table.add_column(f"g{g} (L{layers[0]}-{layers[-1]})", justify="right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    console.print(f"policy written to {out} (cache {cache})")
    return policy
