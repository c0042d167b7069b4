"""The OpenAI wire format: request validation into engine inputs, and response / chunk / error shapes.

``parse_chat_request`` checks a ``POST /v1/chat/completions`` body field by field and returns a
``ChatRequest`` (messages, tools and tool_choice already parsed by ``pask_local.chat`` and
``pask_local.schema``); every problem is an ``APIError`` carrying the HTTP status and OpenAI's
error object ``{"error": {"message", "type", "param", "code"}}``. ``temperature``, ``top_p`` and
``seed`` choose how tokens are drawn (unset or 0: greedy, the server's default, unlike OpenAI's 1: a
call should not change between two identical requests); penalties and ``user`` etc. are accepted
and ignored; fields that would
change the answer but are not supported (``n`` > 1, ``stop``, ``logprobs``, ``response_format``
other than text, the legacy ``functions``) are refused rather than silently dropped. The extension
field ``"pask": {"method": ..., "budget": ...}`` overrides the server's KV method and budget.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from ..errors import PaskError
from ..grammar.sampling import GREEDY, MAX_TEMPERATURE, Sampling
from ..messages import Message, ToolChoice, parse_messages, parse_tool_choice
from ..methods.registry import DEFAULT_METHOD, METHOD_NAMES  # the one list of method names
from ..schema.tools import ToolSpec, load_tools

# accepted and ignored: decoding is greedy and there is no per-user state
IGNORED_FIELDS = frozenset({
    "temperature", "top_p", "seed", "user", "presence_penalty", "frequency_penalty", "metadata", "store",
    "service_tier", "prompt_cache_key", "safety_identifier",
})
KNOWN_FIELDS = frozenset({
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens", "max_completion_tokens",
    "stream", "stream_options", "n", "stop", "logprobs", "top_logprobs", "response_format", "logit_bias",
    "functions", "function_call", "pask",
}) | IGNORED_FIELDS
PASK_FIELDS = ("method", "budget")


class APIError(Exception):
    """An error answered in OpenAI's shape with HTTP ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class Defaults:
    """What a request gets when it does not say: the server's command-line settings."""

    method: str = DEFAULT_METHOD
    budget: float = 0.33
    max_tokens: int = 256


@dataclass
class ChatRequest:
    """A validated chat-completions request, in the engine's terms."""

    model: str
    messages: list[Message]
    tools: list[ToolSpec]
    tool_choice: ToolChoice
    parallel: bool
    max_tokens: int
    stream: bool
    include_usage: bool
    method: str
    budget: float
    sampling: Sampling = GREEDY


def parse_json_body(raw: bytes) -> Any:
    """The parsed body, or a 400."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} "
                          f"column {exc.colno})") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply to parse") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts (sys.int_info)
        raise bad_request(f"the request body holds a value that cannot be read: {str(exc)[:120]}") from None


def _int(body: dict[str, Any], key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{key}' must be an integer, got {type(v).__name__}", key)
    if v < lo:
        raise bad_request(f"'{key}' must be >= {lo}, got {v}", key)
    return v


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean, got {type(v).__name__}", key)
    return v


def _refuse_unsupported(body: dict[str, Any]) -> None:
    unknown = sorted(k for k in body if k not in KNOWN_FIELDS)
    if unknown:
        raise bad_request(f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise bad_request(f"'{key}' must be a number, got {type(v).__name__}", key)
    if body.get("n") not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    if body.get("stop"):
        raise bad_request("'stop' sequences are not supported", "stop")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad_request("logprobs are not supported", "logprobs")
    if body.get("logit_bias"):
        raise bad_request("'logit_bias' is not supported", "logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad_request("'response_format' other than text is not supported; describe the output as a tool "
                          "and use tool_choice", "response_format")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise bad_request("the legacy 'functions' / 'function_call' fields are not supported; use 'tools'",
                          "functions")


def _messages(raw: Any) -> list[Message]:
    if isinstance(raw, list):  # OpenAI's newer "developer" role is the system prompt
        raw = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m for m in raw]
    try:
        return parse_messages(raw)
    except PaskError as exc:
        raise bad_request(str(exc), "messages") from None


def _tools(raw: Any) -> list[ToolSpec]:
    if raw is None or raw == []:
        return []
    if not isinstance(raw, list):
        raise bad_request(f"'tools' must be a list, got {type(raw).__name__}", "tools")
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{"name", "parameters", ...}}}}',
                              f"tools[{i}]")
    try:
        return load_tools(raw)
    except PaskError as exc:
        raise bad_request(f"invalid tools: {exc}", "tools") from None


def _tool_choice(raw: Any, tools: list[ToolSpec]) -> ToolChoice:
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str) and raw not in ("auto", "required", "none"):
        raise bad_request(f"tool_choice must be auto, required, none or a function object, got {raw!r}",
                          "tool_choice")
    try:
        choice = parse_tool_choice(raw, [t.name for t in tools])
    except PaskError as exc:
        raise bad_request(str(exc), "tool_choice") from None
    if not tools and choice.calls:
        raise bad_request(f"tool_choice {choice.mode!r} needs tools, and none were given", "tool_choice")
    return choice


def _pask(raw: Any, defaults: Defaults) -> tuple[str, float]:
    if raw is None:
        return defaults.method, defaults.budget
    if not isinstance(raw, dict):
        raise bad_request('\'pask\' must be an object {"method": ..., "budget": ...}', "pask")
    extra = sorted(set(raw) - set(PASK_FIELDS))
    if extra:
        raise bad_request(f"unknown field pask.{extra[0]} (method, budget)", f"pask.{extra[0]}")
    method = raw.get("method", defaults.method)
    if not isinstance(method, str) or method not in METHOD_NAMES:
        raise bad_request(f"unknown method {method!r} (choose from {', '.join(METHOD_NAMES)})", "pask.method",
                          "unknown_method")
    budget = raw.get("budget", defaults.budget)
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0.0 < budget <= 1.0:
        raise bad_request(f"pask.budget must be a number in (0, 1], got {budget!r}", "pask.budget")
    return method, float(budget)


def parse_chat_request(body: Any, model_id: str, defaults: Defaults) -> ChatRequest:
    """Validate a chat-completions body (parsed JSON) for the model served as ``model_id``."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required (a string)", "model")
    if model != model_id:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_id}'",
                       param="model", code="model_not_found")
    if "messages" not in body:
        raise bad_request("'messages' is required", "messages")
    _refuse_unsupported(body)
    messages = _messages(body["messages"])
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    parallel = _bool(body, "parallel_tool_calls", True)
    max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1) or defaults.max_tokens
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed with stream: true", "stream_options")
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            raise bad_request('\'stream_options\' must be {"include_usage": true|false}', "stream_options")
        include_usage = bool(opts.get("include_usage", False))
    method, budget = _pask(body.get("pask"), defaults)
    return ChatRequest(model=model, messages=messages, tools=tools, tool_choice=choice, parallel=parallel,
                       max_tokens=max_tokens, stream=stream, include_usage=include_usage, method=method,
                       budget=budget, sampling=_sampling(body))


def _sampling(body: dict[str, Any]) -> Sampling:
    """temperature in [0, 2], top_p in [0, 1], seed an integer (numbers checked by ``_refuse_unsupported``)."""
    temperature = body.get("temperature")
    top_p = body.get("top_p")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request(f"'seed' must be an integer, got {type(seed).__name__}", "seed")
    temperature = 0.0 if temperature is None else float(temperature)
    top_p = 1.0 if top_p is None else float(top_p)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise bad_request(f"'temperature' must be in [0, {MAX_TEMPERATURE:g}], got {temperature:g}", "temperature")
    if not 0.0 <= top_p <= 1.0:
        raise bad_request(f"'top_p' must be in [0, 1], got {top_p:g}", "top_p")
    return Sampling(temperature=temperature, top_p=top_p, seed=None if seed is None else seed % 2**64)


# ------------------------------------------------------------------ responses
def completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def now() -> int:
    return int(time.time())


def usage(stats: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens not prefilled (a reused or restored prefix)."""
    n_prompt, n_gen = int(stats["n_prompt"]), int(stats["n_gen"])
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": int(stats.get("prefix_reused") or 0)}}


def pask_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The ``pask`` extension of a response: what the KV method kept."""
    return {"method": stats["method"], "budget": stats["budget"],
            "kv_entries_held": int(sum(stats["held_per_group"])),
            "kv_entries_full": int(sum(stats["full_per_group"])),
            "budget_used_final": stats["budget_used_final"],
            "prefill_ms": stats["prefill_ms"], "ms_per_token": stats["ms_per_token"],
            "prefix_source": stats.get("prefix_source") or None}


def completion_body(cid: str, created: int, model: str, message: dict[str, Any], finish_reason: str,
                    use: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": use, "pask": pask_stats(stats)}


def chunk_body(cid: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None = None,
               include_usage: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                        "logprobs": None}]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(cid: str, created: int, model: str, use: dict[str, Any]) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
            "usage": use}


def models_body(model_id: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": "pask-local"}]}
