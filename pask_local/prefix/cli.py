"""``pask-local compress``: compress a tool catalog's prefix once and save it (``prefix.build``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated

import typer

from ..cli_options import (
    FlashAttnOption,
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


def compress_command(
    tools: Annotated[Path, typer.Option("--tools", help="The tool catalog: OpenAI tools, JSON Schema or BFCL "
                                        "functions, a JSON file.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="The prefix file to write (.pkv).", show_default=False)],
    system: Annotated[Path | None, typer.Option("--system", help="A system prompt (a text file) that comes "
                                                "before the tools.", show_default=False)] = None,
    gguf: Annotated[str | None, typer.Option("--gguf", help="GGUF model: path or hf://owner/repo/file.gguf.",
                                             show_default=False)] = None,
    model: ModelOption = None,
    method: Annotated[str | None, typer.Option("--method", help="A query-agnostic method (`pask-local methods`); "
                                               "default: floors-only (pask with --policy).", show_default=False)] = None,
    budget: Annotated[float, typer.Option("--budget", help="Fraction of the prefix's K/V entries kept.")] = 0.33,
    policy: Annotated[Path | None, typer.Option("--policy", help="Persistence policy JSON (the pask methods).",
                                                show_default=False)] = None,
    prompt_style: Annotated[str, typer.Option("--prompt-style", help="native, plain or auto (as `run`).")
                            ] = "auto",
    parallel: Annotated[bool, typer.Option("--parallel", help="For requests that allow a list of calls (`run "
                                           "--parallel`; the instruction prompt's header differs).")] = False,
    ngl: NglOption = 0,
    flash_attn: FlashAttnOption = False,
    kv_type: KvTypeOption = "f16",
    whole_prefill: WholePrefillOption = False,
    rpc: RpcOption = None,
    tensor_split: TensorSplitOption = None,
    rpc_timeout: RpcTimeoutOption = 60.0,
) -> None:
    """Compress the prompt prefix (system + tools, up to the user's turn) once, without a question, and
    save it; `run --prefix` and `serve --prefix` restore it and prefill only what follows.

    Example: pask-local compress --tools catalog.json --out catalog.pkv
    """
    from ..engine.core import Engine, EngineConfig
    from ..engine.factory import default_run_method, make_method
    from ..llm import Model
    from ..methods.registry import DEFAULT_PREFIX_METHOD
    from ..models import resolve_model
    from ..run_cli import PROMPT_STYLES
    from ..schema.tools import read_tools
    from .build import check_query_agnostic, compress, head_of, save

    method = default_run_method(method, policy, DEFAULT_PREFIX_METHOD)
    check_query_agnostic(method)
    if not 0.0 < budget <= 1.0:
        raise PaskError(f"--budget must be in (0, 1], got {budget}")
    if prompt_style not in PROMPT_STYLES:
        raise PaskError(f"unknown --prompt-style '{prompt_style}' ({', '.join(PROMPT_STYLES)})")
    check_device_options(ngl, 0.02, kv_type)
    if not tools.is_file():
        raise PaskError(f"tools file not found: {tools}")
    specs = read_tools(tools)
    sys_text = _read_text(system) if system is not None else None
    if out.exists() and out.is_dir():
        raise PaskError(f"--out {out} is a directory")
    if not out.parent.is_dir():
        raise PaskError(f"--out: directory {out.parent} does not exist")
    placement = make_placement(rpc, tensor_split, ngl, rpc_timeout)   # before the model loads or --out is written
    m = Model(resolve_model(gguf, model), n_gpu_layers=ngl, placement=placement)
    engine = Engine(m, make_method(method, m, policy), EngineConfig(
        budget=budget, max_tokens=1, style=PROMPT_STYLES[prompt_style], flash_attn=flash_attn, kv_type=kv_type))
    policy_sha = hashlib.sha256(policy.read_bytes()).hexdigest() if policy is not None else None
    typer.echo(f"compressing the prefix ({len(specs)} tools) with {method}"
               + ("" if method == "full" else f" at budget {budget}") + " ...", err=True)
    c = compress(engine, specs, head_of(sys_text), policy_sha, extra={"tools": [t.name for t in specs]},
                 parallel=parallel, whole=whole_prefill)
    size = save(out, c)
    report = {"out": str(out), "bytes": size, "prefix_tokens": c.header.n_prefix, "method": c.header.method,
              "budget": c.header.budget, "held_entries": c.held, "full_entries": c.full,
              "held_share": round(c.held / c.full, 4), "prefill_s": round(c.prefill_s, 2),
              **({"prefill": c.header.extra["prefill"]} if "prefill" in c.header.extra else {})}
    typer.echo(json.dumps(report))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PaskError(f"cannot read {path}: {exc}") from None
