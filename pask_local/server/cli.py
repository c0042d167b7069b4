"""`pask-local serve`: load one model and answer OpenAI chat-completion requests over HTTP.

The options are checked, and the address bound, before the model loads, so a bad flag or a busy
port is a one-line ``error: ...`` without a traceback. The socket is handed to uvicorn as is;
SIGINT or SIGTERM shuts down gracefully (running requests are cancelled) with exit status 0.
Listening beyond loopback without ``--api-key`` is allowed but said loudly.
"""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..cli_options import (
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
from ..engine.factory import DEFAULT_METHOD
from ..errors import PaskError

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _listen(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PaskError(f"cannot resolve --host {host!r}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise PaskError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve_command(
    gguf: Annotated[str | None, typer.Option("--gguf", help="GGUF model: path or hf://owner/repo/file.gguf. "
                                             "Default: the strongest installed instruct model (qwen2.5-coder-1.5b, "
                                             "else -0.5b, else the base gemma3-270m with a notice).",
                                             show_default=False)] = None,
    model: ModelOption = None,
    method: Annotated[str, typer.Option("--method", help="Default KV persistence method (a request may "
                                        "override it with \"pask\": {\"method\": ...}); the default is run's: "
                                        "the most accurate method in the method study that evicts while it "
                                        "reads, so a batched slot takes prompts longer than its budget.")
                      ] = DEFAULT_METHOD,
    budget: Annotated[float, typer.Option("--budget", help="Default fraction of full-KV entries kept, "
                                          "in (0, 1].")] = 0.33,
    slots: Annotated[str, typer.Option("--slots", help="Requests run at once (batched: KV streams of one "
                                       "context; --no-batch: one llama context each), or auto: as many "
                                       "slots of the method and budget as fit in the K/V memory one Full KV "
                                       "slot would take (--no-batch: 1).")] = "auto",
    kv_mem: Annotated[int, typer.Option("--kv-mem", help="Batched: MiB of K/V memory for the slots; the slot "
                                        "count follows from the method and budget (overrides --slots). 0: use "
                                        "--slots.")] = 0,
    batch: Annotated[bool, typer.Option("--batch/--no-batch", help="Continuous batching of all slots in one "
                                        "persistent context (any method; one that prefills the whole prompt "
                                        "first, such as snapkv or pask-hybrid, takes only prompts that fit a "
                                        "slot), or one context per request.")] = True,
    queue: Annotated[int, typer.Option("--queue", help="Requests that may wait for a slot; beyond that: "
                                       "429.")] = 8,
    prefill_tokens: Annotated[int, typer.Option("--prefill-tokens", help="Batched: prompt tokens one step may "
                                                "carry besides the decoding slots' tokens (lower: steadier "
                                                "TPOT, later first tokens); 0: a chunk per prefilling "
                                                "slot.")] = 128,
    prefix: Annotated[list[Path] | None, typer.Option("--prefix", help="A prefix file from `pask-local compress` "
                                                      "(repeatable): loaded once, restored into every request "
                                                      "whose prompt starts with it, which then prefills only "
                                                      "the rest. Its method and budget must be the server's.",
                                                      show_default=False)] = None,
    prefix_dir: Annotated[Path | None, typer.Option("--prefix-dir", help="A directory of prefix files kept "
                                                    "across restarts: its files are loaded at start (one that "
                                                    "fails a check, or is another model's, is skipped with a "
                                                    "line), and a new tool catalog's prefix is compressed once "
                                                    "in the background (query-agnostic methods), saved there "
                                                    "and used by later requests.", show_default=False)] = None,
    prefix_cache: Annotated[bool, typer.Option("--prefix-cache/--no-prefix-cache", help="Batched: a finished "
                                               "request's slot keeps its KV, and a new request whose prompt "
                                               "starts the same way (system prompt, tools) takes it and "
                                               "prefills only the rest.")] = True,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Generation limit when a request sets "
                                            "none.")] = 256,
    max_context: Annotated[int, typer.Option("--max-context", help="Most tokens (prompt + max_tokens) one "
                                             "request may use (batched: a slot's length); 0: the model's "
                                             "trained context (batched: 4096).")] = 0,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8000,
    model_id: Annotated[str | None, typer.Option("--model-id", help="The model name clients send. Default: "
                                                 "the --model name, or the GGUF file's stem.",
                                                 show_default=False)] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn's log level.")] = "info",
    allowed_host: Annotated[list[str] | None, typer.Option("--allowed-host", help="A Host header name the server "
                                                           "answers besides the loopback names and --host (DNS "
                                                           "rebinding); repeat it for several; * answers any.",
                                                           show_default=False)] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="PASK_API_KEY", help="Require "
                                                "'Authorization: Bearer KEY' on every route but /health "
                                                "(env PASK_API_KEY).", show_default=False)] = None,
    body_timeout: Annotated[float, typer.Option("--body-timeout", help="Seconds a request body may take to "
                                                "arrive (then 408).")] = 30.0,
    header_timeout: Annotated[float, typer.Option("--header-timeout", help="Seconds a connection may take to "
                                                  "send a request's headers (then it is closed).")] = 10.0,
    max_connections: Annotated[int, typer.Option("--max-connections", help="Open connections at most (503 "
                                                 "beyond).")] = 64,
    reuse_compressed: Annotated[bool, typer.Option("--reuse-compressed", help="Batched: a method that evicts "
                                                   "while it reads may also start from a prefix another request "
                                                   "compressed (faster; its output may then differ from a fresh "
                                                   "run). Off: a prefix is reused only where that equals a "
                                                   "fresh prefill.")] = False,
    ngl: NglOption = 0,
    flash_attn: FlashAttnOption = False,
    hysteresis: HysteresisOption = 0.02,
    kv_type: KvTypeOption = "f16",
    rpc: RpcOption = None,
    tensor_split: TensorSplitOption = None,
    rpc_timeout: RpcTimeoutOption = 60.0,
) -> None:
    """Serve an OpenAI-compatible /v1/chat/completions endpoint (tools, streaming) for one model.

    Example: pask-local serve --model qwen2.5-coder-0.5b --port 8000
    Then: POST http://127.0.0.1:8000/v1/chat/completions (docs/server.md).
    """
    check_generation_options(method, budget, max_tokens)
    check_device_options(ngl, hysteresis, kv_type)
    placement = make_placement(rpc, tensor_split, ngl, rpc_timeout)
    n_slots = parse_slots(slots)
    if queue < 0:
        raise PaskError(f"--queue must be >= 0, got {queue}")
    if max_context < 0:
        raise PaskError(f"--max-context must be >= 0, got {max_context}")
    if prefill_tokens < 0:
        raise PaskError(f"--prefill-tokens must be >= 0, got {prefill_tokens}")
    if kv_mem < 0:
        raise PaskError(f"--kv-mem must be >= 0 MiB, got {kv_mem}")
    if kv_mem and not batch:
        raise PaskError("--kv-mem sizes the batched pool: drop --no-batch or --kv-mem")
    if not 0 <= port <= 65535:
        raise PaskError(f"--port must be in 0..65535, got {port}")
    if log_level not in LOG_LEVELS:
        raise PaskError(f"unknown --log-level '{log_level}' ({', '.join(LOG_LEVELS)})")
    if model_id is not None and not model_id.strip():
        raise PaskError("--model-id must not be empty")
    for name, value in (("--body-timeout", body_timeout), ("--header-timeout", header_timeout)):
        if not 0 < value <= 3600:
            raise PaskError(f"{name} must be in (0, 3600] seconds, got {value}")
    if max_connections < 1:
        raise PaskError(f"--max-connections must be >= 1, got {max_connections}")
    if api_key is not None and not api_key.strip():
        raise PaskError("--api-key must not be empty")

    try:
        import uvicorn

        from .app import Server, ServerConfig, create_app
        from .guard import LOOPBACK_HOSTS, Guard, host_name, is_wildcard
        from .transport import uvicorn_config
    except ImportError as exc:
        raise PaskError(f"pask-local serve needs the 'serve' extra (starlette, uvicorn, prometheus-client): "
                        f"pip install 'pask-local[serve]' ({exc})") from None
    from ..engine.pool import SlotPool
    from ..llm import Model
    from ..models import default_model_name, resolve_model
    from .openai_io import Defaults

    if not gguf and model is None:
        model = default_model_name()
    path = resolve_model(gguf, model)
    name = model_id or model or path.stem
    guard = Guard.for_server(host, allowed_host or (), api_key)
    if api_key is None and (is_wildcard(host) or host_name(host) not in LOOPBACK_HOSTS):
        print(f"warning: listening on {host} without --api-key: anyone who can reach this address can run "
              f"requests", file=sys.stderr)
    sock = _listen(host, port)
    loaded = Model(path, n_gpu_layers=ngl, placement=placement)
    server = Server(loaded, ServerConfig(model_id=name, defaults=Defaults(method, budget, max_tokens),
                                         slots=n_slots, queue_size=queue, max_context=max_context,
                                         flash_attn=flash_attn, hysteresis=hysteresis, batch=batch,
                                         kv_mem=kv_mem << 20, prefill_tokens=prefill_tokens,
                                         prefix_cache=prefix_cache, kv_type=kv_type, guard=guard,
                                         reuse_compressed=reuse_compressed, body_timeout=body_timeout,
                                         prefixes=tuple(prefix or ()), prefix_dir=prefix_dir))
    for warning in server.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    bound = sock.getsockname()
    if isinstance(server.pool, SlotPool):
        lay = server.pool.layout
        mode = (f"batched: {lay.slots} slot(s) of {lay.slot_len} tokens, K/V {server.pool.kv_bytes / (1 << 20):.1f} "
                f"MiB ({server.pool.slot_bytes / (1 << 20):.1f} per slot)")
    else:
        mode = f"{server.slots} slot(s), a context per request"
    print(f"pask-local serve: {name} ({loaded.arch}, method {method}, budget {budget}, {mode}, "
          f"queue {queue}) on http://{host}:{bound[1]}/v1", file=sys.stderr, flush=True)
    config = uvicorn_config(create_app(server), log_level=log_level, header_timeout=header_timeout,
                            max_connections=max_connections)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal: end with exit 0
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        sock.close()
    print("pask-local serve: stopped", file=sys.stderr)


def parse_slots(text: str) -> int:
    """``--slots``: a count >= 1, or auto (0: sized from the K/V memory by the server)."""
    if text.strip().lower() == "auto":
        return 0
    try:
        n = int(text)
    except ValueError:
        raise PaskError(f"--slots must be a count or auto, got {text!r}") from None
    if n < 1:
        raise PaskError(f"--slots must be >= 1, got {n}")
    return n


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
