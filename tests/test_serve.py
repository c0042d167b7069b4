"""`pask-local serve`: the real server on 127.0.0.1 (uvicorn in a thread, Qwen2.5-Coder-0.5B loaded
once) talked to with the official ``openai`` client: tool calls, streamed tool-call deltas,
parallel calls, tool_choice variants, a conversation with a tool result, concurrent clients, a
client that disconnects mid-stream, a full queue, and bad inputs with OpenAI's error shape and
status codes. The tests pin behaviour (valid calls against the schema, status codes, slots freed),
never one machine's greedy output. Also: the streaming parser, the pool's queue and the request
validation without a model, the engine's ``on_token`` hook, and the ``serve`` command itself."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from conftest import REPO
from serve_helpers import deltas_of, serve_in_thread
from test_cli_errors import assert_one_line_error

from pask_local.engine.factory import DEFAULT_METHOD
from pask_local.engine.isolated_pool import IsolatedPool
from pask_local.engine.pool import QueueFull, RequestCancelled
from pask_local.server.openai_io import APIError, Defaults, parse_chat_request
from pask_local.server.streaming import ReplyStreamer

pytestmark = pytest.mark.slow

MODEL_ID = "qwen2.5-coder-0.5b"
SLOTS, QUEUE = 2, 3

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "description": "IANA zone"}},
                   "required": ["timezone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
LONG_TEXT = [{"role": "user", "content": "Write a long story about a lighthouse keeper in Oslo."}]


def _free_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


@pytest.fixture(scope="module", params=["batched", "isolated"])
def server(request, qwen05_path) -> Iterator[str]:
    """The real app on a free port of 127.0.0.1, served by uvicorn in a thread; stops at module end.

    Twice: continuous batching in one persistent context (the default), and a context per request."""
    from pask_local.llm import Model
    from pask_local.server.app import Server, ServerConfig

    old = os.environ.get("PASK_THREADS")
    os.environ["PASK_THREADS"] = old or "1"  # the test machine runs other jobs: one thread per llama context
    model = Model(qwen05_path)
    srv = Server(model, ServerConfig(MODEL_ID, Defaults(max_tokens=64), slots=SLOTS, queue_size=QUEUE,
                                     max_context=2048, batch=request.param == "batched"))
    try:
        with serve_in_thread(srv) as url:
            yield url
    finally:
        srv.close()
        model.close()
        if old is None:
            del os.environ["PASK_THREADS"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    # no retries: a 429 must reach the test, not be retried away
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


class _Reply:
    """A raw HTTP reply (urllib): status, text, parsed JSON."""

    def __init__(self, status: int, text: str) -> None:
        self.status_code, self.text = status, text

    def json(self) -> Any:
        return json.loads(self.text)


def _http(url: str, body: bytes | None = None, timeout: float = 30) -> _Reply:
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return _Reply(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return _Reply(e.code, e.read().decode())


def _metric(server: str, name: str, labels: str = "") -> float:
    text = _http(server + "/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} ([0-9.e+-]+)$", text, flags=re.M)
    return float(m.group(1)) if m else 0.0


def _wait_idle(server: str, timeout: float = 60) -> None:
    """Until no slot is busy and nothing waits (the metrics say so)."""
    deadline = time.monotonic() + timeout
    while _metric(server, "pask_slots_busy") or _metric(server, "pask_queue_waiting"):
        assert time.monotonic() < deadline, "slots stayed busy"
        time.sleep(0.1)


def _served(client: openai.OpenAI) -> None:
    """The server answers a (short, cheap) request."""
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


def _check_call(call: Any, names: tuple[str, ...] = ("get_weather", "get_time")) -> dict[str, Any]:
    """A call object of the openai client: id, type, a known name, arguments valid against the schema."""
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def _reassemble(chunks: list[Any]) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """(content, calls, finish_reason) from streamed chunks, as an OpenAI client reassembles them."""
    content: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for ch in chunks:
        for choice in ch.choices:
            d = choice.delta
            if d.content:
                content = (content or "") + d.content
            for tc in d.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call: id, type, name, empty arguments
                    assert tc.id and tc.id.startswith("call_") and tc.type == "function"
                    assert tc.function.name and tc.function.arguments == ""
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:              # then argument fragments only
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# ---------------------------------------------------------------- the real server
def test_models_health_and_metrics(server, client) -> None:
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    health = _http(server + "/health").json()
    assert health["status"] == "ok" and health["slots"] == SLOTS and health["queue_capacity"] == QUEUE
    text = _http(server + "/metrics").text
    for name in ("pask_slots_busy", "pask_queue_waiting", "pask_time_to_first_token_seconds_bucket",
                 "pask_time_per_output_token_seconds_bucket", "pask_kv_entries_held_total"):
        assert name in text


def test_required_tool_call(server, client) -> None:
    before = _metric(server, "pask_completion_tokens_total")
    r = client.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=96)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and r.object == "chat.completion" and r.model == MODEL_ID
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0])
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 96
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ext = r.model_extra["pask"]  # the extension: what the KV method kept
    assert ext["method"] == DEFAULT_METHOD and 0 < ext["kv_entries_held"] < ext["kv_entries_full"]
    assert _metric(server, "pask_completion_tokens_total") == before + r.usage.completion_tokens


def test_stream_tool_call_deltas(client) -> None:
    stream = client.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=96, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content, calls, finish = _reassemble(chunks)
    assert finish == "tool_calls" and content is None and len(calls) == 1
    assert len([c for c in chunks if c.choices and c.choices[0].delta.tool_calls]) > 2  # streamed in pieces
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0   # the usage chunk comes last
    assert chunks[-2].choices[0].finish_reason == "tool_calls" and chunks[-2].model_extra["pask"]["method"] == DEFAULT_METHOD
    assert all(c.usage is None for c in chunks[:-1])


def test_parallel_tool_calls(client) -> None:
    msgs = [{"role": "system", "content": "Call get_weather once for every city the user names."},
            {"role": "user", "content": "What is the weather in Oslo, in Paris and in Rome?"}]
    stream = client.chat.completions.create(model=MODEL_ID, messages=msgs, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=True, max_tokens=256, stream=True)
    _, calls, finish = _reassemble(list(stream))
    # the grammar allows a list of calls (up to 8, which fit in 256 tokens); how many is the model's business
    assert finish == "tool_calls" and 1 <= len(calls) <= 8 and len({c["id"] for c in calls}) == len(calls)
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_tool_choice_variants(client) -> None:
    named = client.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, max_tokens=96,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]
    _check_call(named.choices[0].message.tool_calls[0])

    auto = client.chat.completions.create(model=MODEL_ID, messages=USER, tools=[WEATHER], tool_choice="auto",
                                          max_tokens=96)
    msg = auto.choices[0].message
    if msg.tool_calls:  # auto: either a valid call or text, and the finish reason says which
        assert auto.choices[0].finish_reason == "tool_calls"
        for c in msg.tool_calls:
            _check_call(c)
    else:
        assert auto.choices[0].finish_reason in ("stop", "length")

    stream = client.chat.completions.create(model=MODEL_ID, messages=USER, tools=[WEATHER], tool_choice="none",
                                            max_tokens=16, stream=True)
    content, calls, finish = _reassemble(list(stream))
    assert calls == [] and finish in ("stop", "length") and (content is None or isinstance(content, str))


def test_conversation_with_a_tool_result(client) -> None:
    convo = [{"role": "user", "content": "What is the weather in Oslo?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"location": "Oslo"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 3, "sky": "snow"}'},
             {"role": "user", "content": "And in Paris, in fahrenheit?"}]
    r = client.chat.completions.create(model=MODEL_ID, messages=convo, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=96)
    _check_call(r.choices[0].message.tool_calls[0], ("get_weather",))


def test_concurrent_clients_are_all_answered(server, client) -> None:
    _wait_idle(server)
    cities = ["Oslo", "Paris", "Rome"]  # two run, the third waits in the queue

    def ask(city: str) -> Any:
        return client.chat.completions.create(model=MODEL_ID, tools=[WEATHER], tool_choice="required",
                                              messages=[{"role": "user", "content": f"Weather in {city}?"}],
                                              parallel_tool_calls=False, max_tokens=96)

    with ThreadPoolExecutor(len(cities)) as pool:
        replies = list(pool.map(ask, cities))
    for r in replies:
        _check_call(r.choices[0].message.tool_calls[0], ("get_weather",))
    _wait_idle(server)


def test_client_disconnect_frees_its_slot(server, client) -> None:
    _wait_idle(server)
    cancelled = _metric(server, "pask_requests_finished_total", '{reason="cancelled"}')
    stream = client.chat.completions.create(model=MODEL_ID, messages=LONG_TEXT,
                                            max_tokens=400, stream=True)
    got = 0
    for _ in stream:
        got += 1
        if got == 3:
            break
    assert _metric(server, "pask_slots_busy") == 1
    stream.close()  # the client goes away mid-stream
    _wait_idle(server, timeout=20)
    assert _metric(server, "pask_requests_finished_total", '{reason="cancelled"}') == cancelled + 1
    _served(client)


def test_non_streaming_client_that_gives_up_frees_its_slot(server) -> None:
    _wait_idle(server)
    cancelled = _metric(server, "pask_requests_finished_total", '{reason="cancelled"}')
    impatient = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model=MODEL_ID, messages=LONG_TEXT, max_tokens=400)
    _wait_idle(server, timeout=20)
    assert _metric(server, "pask_requests_finished_total", '{reason="cancelled"}') == cancelled + 1


def test_full_queue_is_429_and_the_server_recovers(server, client) -> None:
    _wait_idle(server)
    streams = []
    try:
        for _ in range(SLOTS):
            running = client.chat.completions.create(model=MODEL_ID, messages=LONG_TEXT,
                                                     max_tokens=400, stream=True)
            streams.append(running)
            next(iter(running))  # it runs on a slot
        for _ in range(QUEUE):  # these wait (their response headers are out, no tokens yet)
            streams.append(client.chat.completions.create(model=MODEL_ID, messages=LONG_TEXT, max_tokens=400,
                                                          stream=True))
        assert _metric(server, "pask_queue_waiting") == QUEUE
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(model=MODEL_ID, messages=USER, tools=TOOLS, max_tokens=8)
        assert err.value.status_code == 429 and err.value.code == "rate_limit_exceeded"
        assert err.value.response.headers.get("retry-after") == "1"
    finally:
        for s in streams:
            s.close()
    _wait_idle(server, timeout=30)  # the waiting ones are skipped, the running one stops
    _served(client)


BAD_REQUESTS = [
    # (extra create() arguments, exception, status, code, message needle)
    ({"model": "gpt-9"}, openai.NotFoundError, 404, "model_not_found", "does not exist"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, openai.BadRequestError, 400, None, "unknown role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
     openai.BadRequestError, 400, None, "no earlier assistant message made"),
    ({"messages": []}, openai.BadRequestError, 400, None, "non-empty"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
     openai.BadRequestError, 400, None, "invalid tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/defs/y"}}}}}]}, openai.BadRequestError, 400, None,
     "invalid tools"),
    ({"tools": ["get_weather"]}, openai.BadRequestError, 400, None, "tools[0] must be"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, openai.BadRequestError, 400, None,
     "not among the tools"),
    ({"extra_body": {"pask": {"method": "nope"}}}, openai.BadRequestError, 400, "unknown_method", "unknown method"),
    ({"extra_body": {"pask": {"budget": 1.5}}}, openai.BadRequestError, 400, None, "pask.budget"),
    ({"extra_body": {"pask": {"policy": "/etc/passwd"}}}, openai.BadRequestError, 400, None, "unknown field"),
    ({"max_tokens": 0}, openai.BadRequestError, 400, None, "max_tokens"),
    ({"max_tokens": 10 ** 6}, openai.BadRequestError, 400, "context_length_exceeded", "trained context"),
    ({"messages": [{"role": "user", "content": "hello " * 34000}]}, openai.BadRequestError, 400,
     "context_length_exceeded", "exceed"),
    ({"n": 2}, openai.BadRequestError, 400, None, "n=1"),
    ({"temperature": 3}, openai.BadRequestError, 400, None, "'temperature' must be in [0, 2]"),
    ({"top_p": 1.5}, openai.BadRequestError, 400, None, "'top_p' must be in [0, 1]"),
    ({"extra_body": {"seed": "x"}}, openai.BadRequestError, 400, None, "'seed' must be an integer"),
    ({"stream": True, "max_tokens": 10 ** 6}, openai.BadRequestError, 400, "context_length_exceeded", "exceed"),
    ({"max_tokens": 2000}, openai.BadRequestError, 400, "context_length_exceeded", "context limit (2048)"),
    ({"extra_body": {"frobnicate": True}}, openai.BadRequestError, 400, None, "unrecognized request argument"),
]


@pytest.mark.parametrize("extra,exc,status,code,needle", BAD_REQUESTS,
                         ids=[f"{i}-{b[2]}-{b[4][:20]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors(client, extra, exc, status, code, needle) -> None:
    args = {"model": MODEL_ID, "messages": USER, "tools": TOOLS, "max_tokens": 8, **extra}
    with pytest.raises(exc) as err:
        client.chat.completions.create(**args)
    e = err.value
    assert e.status_code == status and e.code == code and needle in e.message
    body = e.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"


def test_bad_bodies_and_routes_are_4xx_with_the_error_shape(server, client) -> None:
    url = server + "/v1/chat/completions"
    cases = [(b"{not json", 400), (b"[1, 2]", 400), (b"[" * 100000 + b"]" * 100000, 400),
             (json.dumps({"messages": USER}).encode(), 400),
             (b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL_ID.encode(), 400),
             (b'{"model": "%s", "messages": [{"role": "\\ud800", "content": "x"}]}' % MODEL_ID.encode(), 400),
             (b'{"model": "\\ud800", "messages": []}', 404),
             (b"\xff\xfe", 400),
             (json.dumps({"model": MODEL_ID, "messages": USER, "stream": "yes"}).encode(), 400),
             (json.dumps({"model": MODEL_ID, "messages": USER, "stream_options": {"include_usage": True}}).encode(),
              400)]
    for body, status in cases:
        r = _http(url, body)
        assert r.status_code == status, (body[:40], r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = _http(server + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = _http(url)
    assert r.status_code == 405 and "error" in r.json()
    assert _metric(server, "pask_requests_total", '{status="500"}') == 0
    _served(client)  # and the server still serves


def test_a_seeded_sampled_request_repeats_its_call(server, client) -> None:
    """temperature/top_p/seed reach the decoder (tests/test_sampling.py: different seeds draw different
    calls); a sampled call is still a valid one, and with a context per request the same seed gives
    the same call. (In the batched pool the second request starts from the prefix the first one's
    method compressed, the prefix cache: another input, so only validity is checked there.)"""
    args = {"model": MODEL_ID, "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 96,
            "parallel_tool_calls": False, "temperature": 1.3, "top_p": 0.9, "seed": 11}
    a, b = (client.chat.completions.create(**args).choices[0].message.tool_calls for _ in range(2))
    assert len(a) == len(b) == 1
    _check_call(a[0])
    _check_call(b[0])
    if not _http(server + "/health").json()["batch"]:
        assert a[0].function.model_dump() == b[0].function.model_dump()


def test_method_override_in_the_pask_field(client) -> None:
    r = client.chat.completions.create(model=MODEL_ID, messages=USER, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=96,
                                       extra_body={"pask": {"method": "streaming", "budget": 0.2}})
    _check_call(r.choices[0].message.tool_calls[0], ("get_weather",))
    ext = r.model_extra["pask"]
    assert ext["method"] == "streaming" and ext["budget"] == 0.2
    assert ext["kv_entries_held"] < 0.5 * ext["kv_entries_full"]


def test_attention_methods_batched_and_unbatched(server, client) -> None:
    """H2O reads attention every step, SnapKV the window of the whole prompt before it compresses:
    both are served batched (each slot's statistics from its own stream) and unbatched."""
    for method in ("h2o", "snapkv"):
        r = client.chat.completions.create(model=MODEL_ID, messages=USER, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=96,
                                           extra_body={"pask": {"method": method, "budget": 0.2}})
        _check_call(r.choices[0].message.tool_calls[0], ("get_weather",))
        ext = r.model_extra["pask"]
        assert ext["method"] == method and ext["kv_entries_held"] < 0.5 * ext["kv_entries_full"]
    if _http(server + "/health").json()["batch"]:
        # batched, SnapKV's whole prompt must fit a slot's cells (0.33 x 2048 + a chunk, rounded: 768)
        long_user = [{"role": "user", "content": "Weather in Oslo? " + "Please answer soon. " * 250}]
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_ID, messages=long_user, tools=[WEATHER], max_tokens=8,
                                           extra_body={"pask": {"method": "snapkv"}})
        assert info.value.status_code == 400 and "holds 768 prompt tokens at once" in info.value.message
    _served(client)


def test_batched_pool_reports_its_memory(server) -> None:
    health = _http(server + "/health").json()
    if not health["batch"]:
        assert "pool" not in health and "pask_kv_pool_bytes" not in _http(server + "/metrics").text
        return
    pool = health["pool"]
    assert pool["slots"] == SLOTS and pool["slot_len"] == 2048
    assert pool["kv_bytes"] == SLOTS * pool["slot_bytes"] > 0
    assert _metric(server, "pask_kv_pool_bytes") == pool["kv_bytes"]
    assert pool["steps"] > 0 and pool["tokens_per_step"] >= 1.0


# ---------------------------------------------------------------- the engine's hook
def test_on_token_hook_stops_the_decode_loop(qwen05_path) -> None:
    from pask_local.engine import Engine, EngineConfig, make_method
    from pask_local.llm import Model

    os.environ.setdefault("PASK_THREADS", "1")
    model = Model(qwen05_path)
    try:
        engine = Engine(model, make_method("full", model), EngineConfig(max_tokens=200))
        seen: list[int] = []
        result = engine.chat(LONG_TEXT, [], "auto", on_token=lambda t: seen.append(t) or len(seen) >= 5)
        assert result.finish == "cancelled" and seen == result.tokens and len(seen) == 5
    finally:
        model.close()


# ---------------------------------------------------------------- no model: parser, queue, validation
def _stream(text: str, calls: bool, opener: str | None, seed: int) -> tuple[str | None, list[tuple[str, Any]]]:
    import random

    st = ReplyStreamer(calls, opener, "</tool_call>" if opener else None)
    content, out = deltas_of(st, text.encode(), random.Random(seed), 5)
    return content, [(n, json.loads(a)) for n, a in out]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Os\\"lo {x} ø", "n": [1, {"a": 2}]}}\n</tool_call>'
ARGS = {"location": 'Os"lo {x} ø', "n": [1, {"a": 2}]}


@pytest.mark.parametrize("seed", range(12))
def test_reply_streamer_reassembles_what_the_model_wrote(seed) -> None:
    tag = "<tool_call>"
    assert _stream(CALL, True, tag, seed) == (None, [("get_weather", ARGS)])
    two = "  Let me check <tool thing.\n\n" + CALL + "\n" + CALL.replace("get_weather", "get_time")
    assert _stream(two, True, tag, seed) == ("Let me check <tool thing.", [("get_weather", ARGS), ("get_time", ARGS)])
    assert _stream("  plain text, ünïcode  \n", False, tag, seed) == ("plain text, ünïcode", [])
    assert _stream(" text then <tool_cal", True, tag, seed) == ("text then <tool_cal", [])  # never opened
    listed = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": "]}"}}]'
    assert _stream(listed, True, None, seed) == (None, [("a", {}), ("b", {"x": "]}"})])
    assert _stream('{"name": "a", "arguments": {"k": 1.5}}', True, None, seed) == (None, [("a", {"k": 1.5})])


class _Job:
    """An engine stand-in for the pool: ``execute`` runs ``fn(on_token)`` on the slot's thread."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def execute(self, prepared: Any, trace: Any = None, on_token: Any = None) -> Any:
        return self.fn(on_token)


def test_pool_admission_and_cancellation() -> None:
    """The server's queue without a model (the same queue as the batched pool's): slots + queue
    admitted, beyond that QueueFull (429), a cancelled waiting request never runs."""
    pool = IsolatedPool(slots=1, queue_size=1)
    gate = threading.Event()
    try:
        running = pool.submit(_Job(lambda hook: gate.wait(10) and "ran"), None)
        deadline = time.monotonic() + 5
        while pool.busy != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cancel = threading.Event()
        queued = pool.submit(_Job(lambda hook: "never"), None, cancelled=cancel.is_set)
        with pytest.raises(QueueFull):
            pool.submit(_Job(lambda hook: "refused"), None)
        cancel.set()
        gate.set()
        assert running.result(5) == "ran"
        with pytest.raises(RequestCancelled):
            queued.result(5)
        assert pool.submit(_Job(lambda hook: hook(0)), None).result(5) is False  # not cancelled: go on
    finally:
        gate.set()
        pool.close()


@pytest.mark.parametrize("body,status,param", [
    ({"model": "m", "messages": USER, "tools": TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"model": "m", "messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    ({"model": "m", "messages": USER, "parallel_tool_calls": "yes"}, 400, "parallel_tool_calls"),
    ({"model": "m", "messages": USER, "max_tokens": True}, 400, "max_tokens"),
    ({"model": "m", "messages": USER, "temperature": "hot"}, 400, "temperature"),
    ({"model": "m", "messages": USER, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"model": "m", "messages": USER, "functions": []}, 400, "functions"),
    ({"model": "m", "messages": USER, "pask": "snapkv"}, 400, "pask"),
    ({"model": "other", "messages": USER}, 404, "model"),
    ({"messages": USER}, 400, "model"),
    ({"model": "m"}, 400, "messages"),
])
def test_request_validation(body, status, param) -> None:
    with pytest.raises(APIError) as err:
        parse_chat_request(body, "m", Defaults())
    assert err.value.status == status and err.value.param == param


def test_request_defaults_and_developer_role() -> None:
    req = parse_chat_request({"model": "m", "messages": [{"role": "developer", "content": "Be brief."}, *USER],
                              "tools": TOOLS, "temperature": 0.7, "seed": 3}, "m", Defaults("full", 0.5, 99))
    assert req.tool_choice.mode == "auto" and req.parallel and req.max_tokens == 99
    assert (req.method, req.budget, req.stream) == ("full", 0.5, False)
    assert req.messages[0].role == "system"
    assert parse_chat_request({"model": "m", "messages": USER}, "m", Defaults()).tool_choice.mode == "none"


# ---------------------------------------------------------------- the serve command
def _serve(*args: str, **kw: Any) -> subprocess.Popen:
    env = {**os.environ, "PASK_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "pask_local.cli", "serve", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.parametrize("args,needle", [
    (["--budget", "1.5"], "--budget must be in (0, 1]"),
    (["--method", "magic"], "unknown method 'magic'"),
    (["--slots", "0"], "--slots must be >= 1"),
    (["--slots", "many"], "--slots must be a count or auto"),
    (["--body-timeout", "0"], "--body-timeout must be in (0, 3600]"),
    (["--header-timeout", "-1"], "--header-timeout must be in (0, 3600]"),
    (["--max-connections", "0"], "--max-connections must be >= 1"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--queue", "-1"], "--queue must be >= 0"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--max-context", "-5"], "--max-context must be >= 0"),
    (["--kv-mem", "-1"], "--kv-mem must be >= 0"),
    (["--kv-mem", "64", "--no-batch"], "--kv-mem sizes the batched pool"),
    (["--prefill-tokens", "-1"], "--prefill-tokens must be >= 0"),
    (["--kv-mem", "1"], "holds no slot"),
    (["--kv-type", "q9"], "unknown --kv-type"),
    (["--gguf", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
])
def test_serve_bad_options_are_one_line_errors(args, needle) -> None:
    proc = _serve(*args)
    out, err = proc.communicate(timeout=120)
    assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), needle)


def test_serve_command_starts_answers_and_stops(qwen05_path) -> None:
    busy = _free_socket()  # a port in use: a one-line error before the model loads
    proc = _serve("--gguf", str(qwen05_path), "--port", str(busy.getsockname()[1]))
    out, err = proc.communicate(timeout=120)
    busy.close()
    assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), "cannot listen on")

    probe = _free_socket()
    port = probe.getsockname()[1]
    probe.close()
    proc = _serve("--gguf", str(qwen05_path), "--port", str(port), "--model-id", "qwen", "--log-level", "warning")
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if _http(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.2)
        models = _http(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["qwen"]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "pask-local serve: qwen" in err
