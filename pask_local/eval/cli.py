"""The ``pask-local eval`` command: BFCL accuracy of Full KV and the KV-budget methods.

Mounted by ``pask_local/cli.py`` with ``app.command("eval")(eval_command)``. Writes to ``--out``:
``cases.jsonl`` (one record per case x method x budget; rerunning skips finished ones),
``summary.json``, ``results.md`` (accuracy per category x method x budget, average, retention)
and ``accuracy.png``; with ``--fidelity`` also the fidelity columns, ``fidelity.png`` and Full KV's
references in ``fidelity_ref/`` (``eval.fidelity``). Bad input is a one-line ``PaskError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from ..cli_options import (
    HysteresisOption,
    KvTypeOption,
    ModelOption,
    NglOption,
    RpcOption,
    RpcTimeoutOption,
    TensorSplitOption,
    WholePrefillOption,
    check_device_options,
    make_placement,
)
from ..errors import PaskError
from .data import CATEGORIES, canonical_category
from .generator import KNOWN_METHODS, ONCE
from .prompting import check_prompt_style
from .split import check_split

DEFAULT_CATEGORIES = ",".join(CATEGORIES)


def _split_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def eval_command(
    categories: Annotated[str | None, typer.Option(
        help=f"Comma-separated BFCL categories (default: all of {DEFAULT_CATEGORIES}; "
             "with --dataset: all categories in the file).", show_default=False)] = None,
    methods: Annotated[str, typer.Option(help=f"Comma-separated methods: {', '.join(KNOWN_METHODS)}.")] = "full",
    budgets: Annotated[str, typer.Option(help="Comma-separated KV budgets in (0, 1] (methods other than full).")
                       ] = "0.33",
    gguf: Annotated[str | None, typer.Option(
        "--gguf", help="GGUF model: a local path or hf://owner/repo/file.gguf. Default: the embedded "
        "Gemma 3 270M (base, Q4_K_M).", show_default=False)] = None,
    model: ModelOption = None,
    limit: Annotated[int | None, typer.Option(help="At most N cases per category (first N of the split).",
                                              show_default=False)] = None,
    split: Annotated[str | None, typer.Option(
        help="Which split: eval (75%), calib (25%; by hashed case id) or all. Default: eval for the bundled "
             "BFCL categories, all for --dataset (your own cases are evaluated whole).",
        show_default=False)] = None,
    dataset: Annotated[Path | None, typer.Option(
        help="Your own cases in BFCL's format (JSONL or a JSON array), answers inline as 'ground_truth'.",
        show_default=False)] = None,
    answers: Annotated[Path | None, typer.Option(
        help="Possible answers for --dataset in a second file ({id, ground_truth} per line).",
        show_default=False)] = None,
    out: Annotated[Path, typer.Option(help="Output directory (reused to resume).")] = Path("results"),
    max_tokens: Annotated[int, typer.Option(help="Generation limit per case.")] = 256,
    examples: Annotated[bool, typer.Option("--examples/--no-examples",
                                           help="Few-shot examples from the calibration split.")] = True,
    prompt_style: Annotated[str, typer.Option("--prompt-style", help="native: the model's own tool-call protocol "
                                              "(chat templates with tools, e.g. Qwen2.5's <tool_call>); plain: the "
                                              "instruction prompt (base models; few-shot examples); auto: native "
                                              "when the model's template has it.")] = "auto",
    report_only: Annotated[bool, typer.Option("--report-only", help="Only rebuild the tables and plot from the "
                                              "cases already in --out (runs with missing cases show fewer).")] = False,
    fidelity: Annotated[bool, typer.Option("--fidelity", help="Also teacher-force every method along Full KV's "
                                           "own output: KL(Full || method) and top-1 agreement per generated "
                                           "class, and the gold call's NLL (about 3x the generation time; "
                                           "docs/fidelity.md).")] = False,
    fidelity_refs: Annotated[Path | None, typer.Option("--fidelity-refs", help="With --fidelity: the directory "
                                                       "of Full KV's references (default OUT/fidelity_ref). "
                                                       "Runs in several --out directories can share one.",
                                                       show_default=False)] = None,
    hysteresis: HysteresisOption = 0.02,
    compact: Annotated[bool, typer.Option("--compact/--no-compact", help="After a one-time compression (SnapKV, "
                                          "PyramidKV, pask-attn), gather the kept cells at the lowest indices.")]
    = True,
    kv_type: KvTypeOption = "f16",
    whole_prefill: WholePrefillOption = False,
    share_prefill: Annotated[bool, typer.Option("--share-prefill/--no-share-prefill", help="Runs whose method "
                                                "prefills the whole prompt before compressing (snapkv, "
                                                "pyramidkv, pask-attn, any budget) share one prefill per case "
                                                "and decode together; with --catalog-tokens, every run that "
                                                "starts from a group's prefix prefilled whole (those, and once: "
                                                "runs with --whole-prefill) shares one prefill of it.")] = True,
    policy: Annotated[Path | None, typer.Option("--policy", help="A policy file (pask-local calibrate) for pask, "
                                                "pask-attn, pask-hybrid and pask-tools; the other methods run "
                                                "as always. Default: the model's own policy.")] = None,
    catalog_tokens: Annotated[int | None, typer.Option("--catalog-tokens", help="Catalog workload: each group "
                                                       "of cases shares one tool list of about N tokens (its "
                                                       "cases' own functions + distractors from other cases of "
                                                       "the split; docs/catalogs.md).", show_default=False)] = None,
    catalog_group: Annotated[int, typer.Option("--catalog-group", help="With --catalog-tokens: cases per "
                                               "group (one catalog each).")] = 5,
    catalog_seed: Annotated[int, typer.Option("--catalog-seed", help="With --catalog-tokens: the seed of the "
                                              "distractor draw (recorded per group in run.json).")] = 0,
    ngl: NglOption = 0,
    rpc: RpcOption = None,
    tensor_split: TensorSplitOption = None,
    rpc_timeout: RpcTimeoutOption = 60.0,
) -> None:
    """Evaluate function-calling accuracy on BFCL with the official AST checker."""
    from ..models import resolve_model
    from .generator import check_methods
    from .report import markdown, write_reports
    from .runner import EvalConfig, parse_budgets, run_eval

    cats = _split_list(categories) if categories else None
    if cats is not None and dataset is None:
        cats = [canonical_category(c) for c in cats]
    method_list = check_methods(_split_list(methods))
    if not method_list:
        raise PaskError("no method given")
    budget_list = parse_budgets(budgets)
    if split is None:
        split = "all" if dataset is not None else "eval"
    check_split(split)
    check_prompt_style(prompt_style)
    if dataset is not None and not dataset.is_file():
        raise PaskError(f"dataset file not found: {dataset}")
    if answers is not None and dataset is None:
        raise PaskError("--answers needs --dataset")
    if answers is not None and not answers.is_file():
        raise PaskError(f"answers file not found: {answers}")
    if max_tokens < 1:
        raise PaskError(f"--max-tokens must be at least 1, got {max_tokens}")
    check_device_options(ngl, hysteresis, kv_type)
    placement = make_placement(rpc, tensor_split, ngl, rpc_timeout)
    if placement is None and ngl:
        from ..rpc.placement import Placement

        placement = Placement(n_layers=ngl)   # local GPU offload (without --ngl: PASK_NGL, as before)
    if fidelity_refs is not None and not fidelity:
        raise PaskError("--fidelity-refs needs --fidelity")
    if fidelity_refs is not None and fidelity_refs.exists() and not fidelity_refs.is_dir():
        raise PaskError(f"--fidelity-refs {fidelity_refs} is not a directory")
    if catalog_tokens is not None and catalog_tokens < 1:
        raise PaskError(f"--catalog-tokens must be positive, got {catalog_tokens}")
    if catalog_group < 1:
        raise PaskError(f"--catalog-group must be at least 1, got {catalog_group}")
    if policy is not None:
        from ..methods.registry import POLICY_METHODS
        from ..policy.schema import Policy

        Policy.load(policy)  # a one-line error for a missing file or one that is not a policy
        if not any(m.removeprefix(ONCE) in POLICY_METHODS for m in method_list):
            raise PaskError(f"--policy applies to {', '.join(POLICY_METHODS)}; none of them is in --methods")
    cfg = EvalConfig(gguf=resolve_model(gguf, model), out=out, methods=method_list, budgets=budget_list,
                     categories=cats, limit=limit, split=split, dataset=dataset, answers=answers,
                     max_tokens=max_tokens, use_examples=examples, report_only=report_only,
                     prompt_style=prompt_style, fidelity=fidelity, fidelity_refs=fidelity_refs, hysteresis=hysteresis,
                     compact=compact, kv_type=kv_type, share_prefill=share_prefill, policy=policy,
                     catalog_tokens=catalog_tokens, catalog_group=catalog_group, catalog_seed=catalog_seed,
                     placement=placement, whole_prefill=whole_prefill)
    store, cases, runs = run_eval(cfg, Console(stderr=True))
    summary = write_reports(store, cases, runs)
    typer.echo(markdown(summary))
    extra = (", fidelity.png" + ("" if fidelity_refs else ", fidelity_ref/")) if fidelity else ""
    typer.echo(f"results in {out}/ (cases.jsonl, summary.json, results.md, accuracy.png{extra})")
