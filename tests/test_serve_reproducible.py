"""The same request gives the same reply, before and after other requests (real server, real client).

A batched server on 127.0.0.1 (Qwen2.5-Coder-0.5B) with its prefix cache on: one greedy request, then
ten others with the same tools and other questions (two at a time), then the first one again. With
Full KV the second copy starts from a cached prefix and must still equal the first (the reuse equals
a fresh prefill); with the default method (which evicts while it reads) nothing compressed under
another request is reused, so it must be equal too. ``--reuse-compressed`` is the opt-in that does
reuse such prefixes: the test checks that it does, not what it answers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serve_helpers import WEATHER_TIME_TOOLS as TOOLS
from serve_helpers import serve_in_thread

from pask_local.engine.factory import DEFAULT_METHOD

pytestmark = pytest.mark.slow

MODEL_ID = "qwen2.5-coder-0.5b"
FIRST = "What is the weather in Oslo in celsius, and what time is it there?"
OTHERS = [f"What is the weather in {city}?" for city in
          ("Lima", "Cairo", "Perth", "Quito", "Seoul", "Dakar", "Hanoi", "Turin", "Omaha", "Bern")]


def _serve(qwen05_path, method: str, reuse_compressed: bool = False) -> Iterator[tuple[openai.OpenAI, object]]:
    from pask_local.llm import Model
    from pask_local.server.app import Server, ServerConfig
    from pask_local.server.openai_io import Defaults

    old = os.environ.get("PASK_THREADS")
    os.environ["PASK_THREADS"] = old or "1"
    model = Model(qwen05_path)
    srv = Server(model, ServerConfig(MODEL_ID, Defaults(method=method, max_tokens=48), slots=2, queue_size=16,
                                     max_context=1024, reuse_compressed=reuse_compressed))
    try:
        with serve_in_thread(srv) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300), srv
    finally:
        srv.close()
        model.close()
        if old is None:
            del os.environ["PASK_THREADS"]


def _ask(client: openai.OpenAI, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": text}], tools=TOOLS,
                                       tool_choice="required", max_tokens=48)
    msg = r.choices[0].message
    return msg.content, [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]


def _before_and_after(client: openai.OpenAI) -> tuple[object, object]:
    first = _ask(client, FIRST)
    with ThreadPoolExecutor(2) as pool:
        others = list(pool.map(lambda q: _ask(client, q), OTHERS))
    assert all(calls for _, calls in others), others
    return first, _ask(client, FIRST)


@pytest.mark.parametrize("method", ["full", DEFAULT_METHOD])
def test_same_request_same_reply_after_ten_others(qwen05_path, method):
    for client, srv in _serve(qwen05_path, method):
        first, again = _before_and_after(client)
        assert first[1], "no call"
        assert again == first
        reused = srv.pool.stats()["reused_prompt_tokens"]
        if method == "full":
            assert reused > 0  # the equal reply came through the prefix cache
        else:
            assert reused == 0  # nothing compressed under another request was taken


def test_reuse_compressed_is_opt_in(qwen05_path):
    for client, srv in _serve(qwen05_path, DEFAULT_METHOD, reuse_compressed=True):
        _before_and_after(client)
        assert srv.pool.stats()["reused_prompt_tokens"] > 0
