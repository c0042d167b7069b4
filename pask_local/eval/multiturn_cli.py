"""``multiturn_command``: BFCL multi-turn conversations on the in-process engine (``eval.multiturn``).

Meant to be mounted as ``app.command("eval-multiturn")(multiturn_command)`` in ``pask_local/cli.py``.
Writes ``OUT/cases.jsonl`` (one record per conversation; rerunning skips finished ids),
``OUT/run.json`` (the settings; another run with other settings is refused) and
``OUT/summary.json``; prints one line per conversation (stderr), then the JSON summary and a
markdown table (stdout). Bad input is a one-line ``PaskError``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..cli_options import FlashAttnOption, KvTypeOption, ModelOption, NglOption, check_device_options
from ..errors import PaskError
from .multiturn_env import MULTI_TURN_CATEGORIES


def _split_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def multiturn_command(
    categories: Annotated[str, typer.Option(help=f"Comma-separated categories: {', '.join(MULTI_TURN_CATEGORIES)}.")
                          ] = "multi_turn_base",
    gguf: Annotated[str | None, typer.Option("--gguf", help="GGUF model: a local path or hf://owner/repo/file.gguf. "
                                             "It needs its own tool-call protocol (e.g. Qwen2.5).",
                                             show_default=False)] = None,
    model: ModelOption = None,
    method: Annotated[str, typer.Option(help="KV method: full, snapkv, pask-hybrid, ... (as `pask-local run`).")
                      ] = "full",
    budget: Annotated[float, typer.Option(help="KV budget in (0, 1] (methods other than full).")] = 0.33,
    policy: Annotated[Path | None, typer.Option(help="A policy file for the pask methods.", show_default=False)
                      ] = None,
    split: Annotated[str, typer.Option(help="eval (75%), calib (25%; by hashed id) or all.")] = "eval",
    limit: Annotated[int | None, typer.Option(help="At most N conversations per category (first N of the split).",
                                              show_default=False)] = None,
    ids: Annotated[str | None, typer.Option(help="Comma-separated conversation ids (e.g. multi_turn_base_3); "
                                            "--split all to reach any id.", show_default=False)] = None,
    out: Annotated[Path, typer.Option(help="Output directory (reused to resume).")] = Path("results-multiturn"),
    max_tokens: Annotated[int, typer.Option(help="Generation limit per model reply.")] = 256,
    max_steps: Annotated[int | None, typer.Option(help="Steps per turn before it is force-quit (default: BFCL's "
                                                  "MAXIMUM_STEP_LIMIT, 20).", show_default=False)] = None,
    max_turns: Annotated[int | None, typer.Option(help="Play and score only the first N turns (smoke runs).",
                                                  show_default=False)] = None,
    prompt_style: Annotated[str, typer.Option("--prompt-style", help="native or auto (the model's own tool-call "
                                              "protocol; plain is refused).")] = "native",
    ngl: NglOption = 0,
    flash_attn: FlashAttnOption = False,
    kv_type: KvTypeOption = "f16",
    reuse: Annotated[int, typer.Option("--reuse", help="Run the steps in a one-slot pool of N tokens with exact "
                                       "prefix reuse (as `pask-local serve --slots 1`): each step prefills only "
                                       "what it adds; 0: each step in a fresh context.")] = 0,
) -> None:
    """Play BFCL multi-turn conversations; score them with BFCL's multi-turn checker (and per turn)."""
    from ..methods import METHOD_NAMES
    from ..methods.registry import PASK_VARIANTS
    from ..models import resolve_model
    from .multiturn import engine_caller, markdown, run_multiturn, select_conversations, summarize
    from .split import check_split

    if method not in METHOD_NAMES:
        raise PaskError(f"unknown method {method!r}; choose from {', '.join(METHOD_NAMES)}")
    if not 0.0 < budget <= 1.0:
        raise PaskError(f"--budget must be in (0, 1], got {budget}")
    if policy is not None and method not in PASK_VARIANTS:
        raise PaskError(f"--policy applies to the pask methods, not {method!r}")
    if max_tokens < 1:
        raise PaskError(f"--max-tokens must be at least 1, got {max_tokens}")
    if max_steps is not None and max_steps < 1:
        raise PaskError(f"--max-steps must be at least 1, got {max_steps}")
    if max_turns is not None and max_turns < 1:
        raise PaskError(f"--max-turns must be at least 1, got {max_turns}")
    if reuse < 0:
        raise PaskError(f"--reuse must be 0 or a token count, got {reuse}")
    check_split(split)
    check_device_options(ngl, 0.02, kv_type)
    convs = select_conversations(_split_list(categories), split, limit, _split_list(ids) if ids else None)
    if not convs:
        raise PaskError(f"no conversations selected (categories {categories}, split {split})")
    path = resolve_model(gguf, model)
    run_budget = None if method == "full" else budget
    settings = {"gguf": str(path), "method": method, "budget": run_budget, "max_tokens": max_tokens,
                "prompt_style": prompt_style, "kv_type": kv_type, "policy": str(policy) if policy else None, "reuse": reuse}
    caller, close = engine_caller(path, method, budget, max_tokens, prompt_style, ngl, flash_attn, kv_type,
                                  policy=policy, reuse_len=reuse)
    try:
        records = run_multiturn(convs, caller, out, method=method, budget=run_budget, settings=settings,
                                max_steps=max_steps, max_turns=max_turns,
                                log=lambda line: typer.echo(line, err=True))
    finally:
        close()
    summary = summarize(records)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    typer.echo(json.dumps(summary, indent=2))
    typer.echo(markdown(summary))
