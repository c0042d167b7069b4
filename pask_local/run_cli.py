"""`pask-local run`: one function call (or a list of parallel calls) for a request and a tool schema.

stdout carries only the call as JSON (validated against the schema); with ``--messages`` (a
conversation) or a ``--tool-choice`` that allows text (auto, none), the OpenAI-shaped assistant
message ``{"role": "assistant", "content": ..., "tool_calls": [...]}`` instead; ``--stats`` prints a table of
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

from .cli_options import (
    FlashAttnOption,
    HysteresisOption,
    KvTypeOption,
    ModelOption,
    NglOption,
    RpcOption,
    RpcTimeoutOption,
    TensorSplitOption,
    check_device_options,
    check_generation_options,
    make_placement,
)
from .errors import PaskError
from .jsonfile import read_json_file
from .methods.registry import DEFAULT_METHOD, POLICY_FILE_METHOD, choices_help

PROMPT_STYLES = {"auto": "auto", "native": "native", "plain": "instruction"}
METHOD_HELP = (f"KV persistence method. Default: {DEFAULT_METHOD}, as the server's (the most accurate method of "
               f"the method study that evicts while it reads), or {POLICY_FILE_METHOD} when --policy is given. "
               f"`pask-local methods` lists them. Choices: {choices_help()}.")


def _read_messages(path: Path) -> tuple[list, object | None, object | None]:
    """(messages, tools or None, tool_choice or None) from a message list or an OpenAI request body."""
    data = read_json_file(path, "messages")
    if isinstance(data, dict) and "messages" in data:
        return data["messages"], data.get("tools"), data.get("tool_choice")
    return data, None, None


def _tool_choice(text: str | None) -> object | None:
    """--tool-choice: auto | required | none | a JSON object | a bare function name."""
    if text is None or text in ("auto", "required", "none") or text.lstrip().startswith("{"):
        return text
    return {"type": "function", "function": {"name": text}}


def run_command(
    request: Annotated[str | None, typer.Argument(help="What the user asks for.", show_default=False)] = None,
    schema: Annotated[Path | None, typer.Option("--schema", help="Tool definitions (OpenAI tools, JSON Schema "
                                                "or BFCL functions), a JSON file.", show_default=False)] = None,
    gguf: Annotated[str | None, typer.Option("--gguf", help="GGUF model: path or hf://owner/repo/file.gguf. "
                                             "Default: the strongest installed instruct model (qwen2.5-coder-1.5b, "
                                             "else -0.5b, else the base gemma3-270m with a notice).",
                                             show_default=False)] = None,
    model: ModelOption = None,
    method: Annotated[str | None, typer.Option("--method", help=METHOD_HELP, show_default=False)] = None,
    budget: Annotated[float | None, typer.Option("--budget", help="Fraction of full-KV entries kept, in (0, 1]. "
                                                 "Default: 0.33 (with --prefix: the file's).",
                                                 show_default=False)] = None,
    policy: Annotated[Path | None, typer.Option("--policy", help="Persistence policy JSON (pask, pask-attn, pask-hybrid, pask-tools; "
                                                "without --method it runs as pask). Default: the model's shipped "
                                                "policy.", show_default=False)] = None,
    parallel: Annotated[bool, typer.Option("--parallel", help="Allow a list of calls.")] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Generation limit.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", help="0: greedy; up to 2: sample (under the "
                                               "call grammar).")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Sample from the smallest set of tokens holding this "
                                         "much of the allowed probability.")] = 1.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed for sampling (the same seed repeats a draw).",
                                             show_default=False)] = None,
    trace: Annotated[Path | None, typer.Option("--trace", help="Write a JSONL trace of what persisted where "
                                               "(view it with `pask-local tui`).", show_default=False)] = None,
    messages: Annotated[Path | None, typer.Option("--messages", help="A conversation instead of REQUEST: an "
                                                  "OpenAI-style message list (system, user, assistant with "
                                                  "tool_calls, tool results), or a request body {messages, tools, "
                                                  "tool_choice}. Prints the assistant message.",
                                                  show_default=False)] = None,
    tool_choice: Annotated[str | None, typer.Option("--tool-choice", help="auto (text or a call), required, none "
                                                    "(text only), or one function: its name or {\"type\": "
                                                    "\"function\", \"function\": {\"name\": ...}}. Default: "
                                                    "required for REQUEST, auto for --messages.",
                                                    show_default=False)] = None,
    prompt_style: Annotated[str, typer.Option("--prompt-style", help="native (the model's own tool-call "
                                              "protocol), plain (the instruction prompt), or auto (native when "
                                              "the model's chat template has one).")] = "auto",
    stats: Annotated[bool, typer.Option("--stats", help="Print tokens, budget used, retention, ms/token "
                                        "(stderr).")] = False,
    stats_json: Annotated[bool, typer.Option("--stats-json", help="Print the stats as JSON on stderr.")] = False,
    tui: Annotated[bool, typer.Option("--tui", help="Watch the run in the trace viewer (writes --trace, or a "
                                      "temporary trace).")] = False,
    ngl: NglOption = 0,
    flash_attn: FlashAttnOption = False,
    hysteresis: HysteresisOption = 0.02,
    kv_type: KvTypeOption = "f16",
    prefix: Annotated[Path | None, typer.Option("--prefix", help="A prefix file from `pask-local compress`: its "
                                                "compressed K/V is restored and only what follows it is "
                                                "prefilled (its method and budget, unless given).",
                                                show_default=False)] = None,
    rpc: RpcOption = None,
    tensor_split: TensorSplitOption = None,
    rpc_timeout: RpcTimeoutOption = 60.0,
) -> None:
    """Generate a schema-valid function call for REQUEST under a KV budget.

    Example: pask-local run --schema examples/get_weather.json "Weather in Paris in celsius?"
    A conversation: pask-local run --schema examples/get_weather.json --messages chat.json
    """
    file_tools = choice_raw = None
    convo: list | None = None
    if messages is not None:
        if request:
            raise PaskError("give either REQUEST or --messages, not both")
        convo, file_tools, choice_raw = _read_messages(messages)
    elif not request or not request.strip():
        raise PaskError("no request given (pass REQUEST or --messages FILE)")
    if schema is None and file_tools is None:
        raise PaskError("--schema FILE is required (or tools in the --messages request body)")
    if prompt_style not in PROMPT_STYLES:
        raise PaskError(f"unknown --prompt-style '{prompt_style}' ({', '.join(PROMPT_STYLES)})")
    from .engine.factory import default_run_method

    placement = make_placement(rpc, tensor_split, ngl, rpc_timeout)
    loaded = header = blob = None
    if prefix is not None:  # the file's method and budget unless given (checked against the file below)
        from .llm import Model
        from .models import resolve_model
        from .prefix.build import open_file

        loaded = Model(resolve_model(gguf, model), n_gpu_layers=ngl, placement=placement)
        header, blob = open_file(prefix, loaded)
        method = method or header.method
        if budget is None:
            budget = header.budget if header.budget is not None else 1.0
    budget = 0.33 if budget is None else budget
    method = default_run_method(method, policy)
    check_generation_options(method, budget, max_tokens)
    check_device_options(ngl, hysteresis, kv_type)
    from .grammar.sampling import Sampling

    sampling = Sampling(temperature=temperature, top_p=top_p, seed=None if seed is None else seed % 2**64)

    from .engine import Engine, EngineConfig, make_method
    from .llm import Model
    from .messages import parse_messages, parse_tool_choice, user_message
    from .models import resolve_model
    from .schema.tools import load_tools, read_tools

    if schema is not None and not schema.is_file():
        raise PaskError(f"schema file not found: {schema}")
    tools = read_tools(schema) if schema is not None else load_tools(file_tools)
    msgs = parse_messages(convo) if convo is not None else user_message(request or "")
    default_choice = "auto" if convo is not None else "required"
    choice = parse_tool_choice(_tool_choice(tool_choice) or choice_raw or default_choice, [t.name for t in tools])
    model = loaded or Model(resolve_model(gguf, model), n_gpu_layers=ngl, placement=placement)
    warn = Console(stderr=True).print
    engine = Engine(model, make_method(method, model, policy, warn=lambda m: warn(f"warning: {m}")),
                    EngineConfig(budget=budget, max_tokens=max_tokens, style=PROMPT_STYLES[prompt_style],
                                 flash_attn=flash_attn, hysteresis=hysteresis, kv_type=kv_type))
    if tui:
        from .tui.cli import run_tui

        result = run_tui(lambda p: engine.chat(msgs, tools, choice, parallel=parallel, trace=p, sampling=sampling),
                         trace)
    elif prefix is not None:
        from .prefix.build import check_prompt, pin, run_from_prefix

        pinned = pin(prefix, header, blob, model, engine.method.name,  # type: ignore[arg-type]
                     None if engine.method.keeps_all else budget, kv_type, tools)
        prepared = engine.prepare(msgs, tools, choice, parallel=parallel, sampling=sampling)
        check_prompt(header.tokens, prepared.plan.prompt.tokens, prefix.name)  # type: ignore[union-attr]
        result = run_from_prefix(engine, prepared, pinned, trace)
    else:
        result = engine.chat(msgs, tools, choice, parallel=parallel, trace=trace, sampling=sampling)
    for line in result.stats.get("warnings", []):
        print(f"warning: {line}", file=sys.stderr)   # the budget could not be met (floors win)
    if stats:
        _print_stats(result.stats)
    if stats_json:
        print(json.dumps(result.stats), file=sys.stderr)
    if not result.ok:
        print(result.text, file=sys.stderr)
        raise PaskError(f"the model's output is not a valid call: {result.error}")
    if convo is None and choice.calls:
        print(json.dumps(result.parsed, ensure_ascii=False))   # REQUEST: the call JSON, as always
    else:
        print(json.dumps(result.message.to_openai(), ensure_ascii=False))


def _print_stats(s: dict) -> None:
    title = "full KV (no budget)" if s["budget"] is None else f"{s['method']} @ budget {s['budget']}"
    t = Table(title=title, show_header=False)
    t.add_row("prompt tokens", str(s["n_prompt"]))
    t.add_row("generated tokens", str(s["n_gen"]))
    t.add_row("KV used after prefill", f"{s['budget_used_after_prefill']:.3f} of full")
    t.add_row("KV used at the end", f"{s['budget_used_final']:.3f} of full")
    t.add_row("retention per layer group", "  ".join(
        f"g{g}: {h}/{f}" for g, (h, f) in enumerate(zip(s["held_per_group"], s["full_per_group"], strict=True))))
    t.add_row("KV bytes allocated", f"{s['kv_bytes_allocated'] / 2**20:.2f} MiB"
              + (f" (of which {s['kv_bytes_alignment'] / 2**20:.2f} MiB: capacities rounded to 256 cells)"
                 if s.get("kv_bytes_alignment") else ""))
    t.add_row("persistence step", f"{s.get('step_ms_per_token', 0.0):.2f} ms/token")
    t.add_row("prefill", f"{s['prefill_ms']:.0f} ms" + (
        f" ({s['prefix_reused']} prompt tokens restored from a prefix file)"
        if s.get("prefix_source") == "prefix" else ""))
    t.add_row("decode", f"{s['ms_per_token']:.1f} ms/token")
    sm = s["sampler"]
    t.add_row("grammar checks", f"fast {sm['fast']}, block {sm['block']}, full {sm['full']}")
    Console(stderr=True).print(t)
