"""`pask-local run`: one function call (or a list of parallel calls) for a request and a tool schema.

stdout carries only the call as JSON (validated against the schema); ``--stats`` prints a table of
tokens, budget actually used, per-group retention and ms/token to stderr (``--stats-json`` as JSON).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .errors import PaskError
from .jsonfile import read_json_file

METHOD_HELP = ("KV persistence method: pask, full, streaming, h2o, snapkv, pyramidkv, tova, pask-prior "
               "(PASK with the hand-written prior policy) or pask-attn (PASK's class shares, ranked by "
               "attention inside each class).")


def _request_from_messages(path: Path) -> str:
    data = read_json_file(path, "messages")
    if not isinstance(data, list) or not data or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in data):
        raise PaskError(f"{path}: expected a non-empty list of {{\"role\": ..., \"content\": ...}} messages")
    if data[-1]["role"] != "user":
        raise PaskError(f"{path}: the last message must be the user's")
    if len(data) == 1:
        return data[0]["content"]
    history = "\n".join(f"{m['role']}: {m['content']}" for m in data[:-1])
    return f"{history}\nuser: {data[-1]['content']}"


def run_command(
    request: Annotated[str | None, typer.Argument(help="What the user asks for.", show_default=False)] = None,
    schema: Annotated[Path | None, typer.Option("--schema", help="Tool definitions (OpenAI tools, JSON Schema "
                                                "or BFCL functions), a JSON file.", show_default=False)] = None,
    gguf: Annotated[str | None, typer.Option("--gguf", help="GGUF model: path or hf://owner/repo/file.gguf. "
                                             "Default: embedded Gemma 3 270M.", show_default=False)] = None,
    method: Annotated[str, typer.Option("--method", help=METHOD_HELP)] = "pask",
    budget: Annotated[float, typer.Option("--budget", help="Fraction of full-KV entries kept, in (0, 1].")] = 0.33,
    policy: Annotated[Path | None, typer.Option("--policy", help="Persistence policy JSON (pask, pask-attn). "
                                                "Default: the model's shipped policy.", show_default=False)] = None,
    parallel: Annotated[bool, typer.Option("--parallel", help="Allow a list of calls.")] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Generation limit.")] = 256,
    trace: Annotated[Path | None, typer.Option("--trace", help="Write a JSONL trace of what persisted where "
                                               "(view it with `pask-local tui`).", show_default=False)] = None,
    messages: Annotated[Path | None, typer.Option("--messages", help="A chat history (JSON list of role/content "
                                                  "messages) instead of REQUEST.", show_default=False)] = None,
    stats: Annotated[bool, typer.Option("--stats", help="Print tokens, budget used, retention, ms/token "
                                        "(stderr).")] = False,
    stats_json: Annotated[bool, typer.Option("--stats-json", help="Print the stats as JSON on stderr.")] = False,
    tui: Annotated[bool, typer.Option("--tui", help="Watch the run in the trace viewer (writes --trace, or a "
                                      "temporary trace).")] = False,
) -> None:
    """Generate a schema-valid function call for REQUEST under a KV budget.

    Example: pask-local run --schema examples/get_weather.json "Weather in Paris in celsius?"
    """
    if messages is not None:
        if request:
            raise PaskError("give either REQUEST or --messages, not both")
        request = _request_from_messages(messages)
    if not request or not request.strip():
        raise PaskError("no request given (pass REQUEST or --messages FILE)")
    if schema is None:
        raise PaskError("--schema FILE is required")
    if not 0.0 < budget <= 1.0:
        raise PaskError(f"--budget must be in (0, 1], got {budget}")
    if max_tokens < 1:
        raise PaskError(f"--max-tokens must be >= 1, got {max_tokens}")

    from .engine import Engine, EngineConfig, make_method
    from .llm import Model
    from .methods import METHOD_NAMES
    from .models import resolve_model
    from .schema.tools import read_tools

    if method not in METHOD_NAMES:
        raise PaskError(f"unknown method '{method}' (choose from {', '.join(METHOD_NAMES)})")
    if not schema.is_file():
        raise PaskError(f"schema file not found: {schema}")
    tools = read_tools(schema)
    model = Model(resolve_model(gguf))
    warn = Console(stderr=True).print
    engine = Engine(model, make_method(method, model, policy, warn=lambda m: warn(f"warning: {m}")),
                    EngineConfig(budget=budget, max_tokens=max_tokens))
    if tui:
        from .tui.cli import run_tui

        result = run_tui(lambda p: engine.run(tools, request, parallel=parallel, trace=p), trace)
    else:
        result = engine.run(tools, request, parallel=parallel, trace=trace)
    if stats:
        _print_stats(result.stats)
    if stats_json:
        print(json.dumps(result.stats), file=sys.stderr)
    if not result.ok:
        print(result.text, file=sys.stderr)
        raise PaskError(f"the model's output is not a valid call: {result.error}")
    print(json.dumps(result.parsed, ensure_ascii=False))


def _print_stats(s: dict) -> None:
    title = "full KV (no budget)" if s["budget"] is None else f"{s['method']} @ budget {s['budget']}"
    t = Table(title=title, show_header=False)
    t.add_row("prompt tokens", str(s["n_prompt"]))
    t.add_row("generated tokens", str(s["n_gen"]))
    t.add_row("KV used after prefill", f"{s['budget_used_after_prefill']:.3f} of full")
    t.add_row("KV used at the end", f"{s['budget_used_final']:.3f} of full")
    t.add_row("retention per layer group", "  ".join(
        f"g{g}: {h}/{f}" for g, (h, f) in enumerate(zip(s["held_per_group"], s["full_per_group"], strict=True))))
    t.add_row("KV bytes allocated", f"{s['kv_bytes_allocated'] / 2**20:.2f} MiB")
    t.add_row("prefill", f"{s['prefill_ms']:.0f} ms")
    t.add_row("decode", f"{s['ms_per_token']:.1f} ms/token")
    sm = s["sampler"]
    t.add_row("grammar checks", f"fast {sm['fast']}, block {sm['block']}, full {sm['full']}")
    Console(stderr=True).print(t)
