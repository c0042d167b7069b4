"""For the server's tests: a real server (a ``Server``'s app under uvicorn in a thread, on a free port of
127.0.0.1), a streamer's deltas gathered back into content and calls, and two tools to ask about."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# two OpenAI tools the server tests ask about (weather and time)
WEATHER_TIME_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "City name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the local time in a time zone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "description": "IANA zone"}},
                       "required": ["timezone"]}}},
]


@contextmanager
def serve_in_thread(server: Any) -> Iterator[str]:
    """Serve ``server`` (a ``pask_local.server.app.Server``) until the block ends; yields its base URL."""
    import uvicorn

    from pask_local.server.app import create_app

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    userver = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning"))
    thread = threading.Thread(target=userver.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not userver.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        userver.should_exit = True
        thread.join(15)
        sock.close()


def deltas_of(streamer: Any, data: bytes, rng: random.Random | None, most: int) -> tuple[str | None, list[tuple[str, str]]]:
    """Feed ``data`` to a ``ReplyStreamer`` in pieces of 1..``most`` bytes (``rng`` None: byte by byte, even
    inside UTF-8 characters); the streamed content and the (name, arguments text) of each call."""
    deltas, i = [], 0
    while i < len(data):
        n = rng.randint(1, most) if rng is not None else 1
        deltas += streamer.feed_bytes(data[i:i + n])
        i += n
    deltas += streamer.finish()
    content = "".join(d.get("content", "") for d in deltas) or None
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["function"]["arguments"] == "" and tc["index"] not in calls
                calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                calls[tc["index"]][1] += tc["function"]["arguments"]
    return content, [(n, a) for n, a in (calls[k] for k in sorted(calls))]
