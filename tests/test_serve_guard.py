"""The server's front door without a model: Host allow-list, JSON-only POSTs, the API key (through
Starlette's test client on the real middleware), the preparation gate, the message-size bound, the
5,000-digit integer, ``--slots`` and the default model's choice."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pask_local.errors import PaskError
from pask_local.model_registry import DEFAULT_MODEL, PREFERRED_MODELS, pick_default_model
from pask_local.server.app import PrepareGate, message_chars
from pask_local.server.cli import parse_slots
from pask_local.server.guard import Guard, GuardMiddleware, host_name, is_wildcard
from pask_local.server.openai_io import APIError, parse_json_body


def _app(guard: Guard) -> TestClient:
    async def ok(request):
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/chat/completions", ok, methods=["POST"]), Route("/v1/models", ok),
                            Route("/health", ok)], middleware=[Middleware(GuardMiddleware, guard=guard)])
    return TestClient(app, base_url="http://127.0.0.1:8000")


@pytest.mark.parametrize(("header", "name"), [("localhost:8000", "localhost"), ("[::1]:8000", "::1"),
                                              ("127.0.0.1", "127.0.0.1"), ("Example.COM.", "example.com"),
                                              ("[::1", "")])
def test_host_name(header, name):
    assert host_name(header) == name


def test_wildcards():
    assert is_wildcard("0.0.0.0") and is_wildcard("::") and not is_wildcard("127.0.0.1")
    assert not is_wildcard("localhost")


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "127.0.0.1.nip.io", ""])
def test_foreign_host_is_refused(host):
    r = _app(Guard.for_server("127.0.0.1")).get("/v1/models", headers={"Host": host})
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "host_not_allowed"


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1:8000", "[::1]:8000"])
def test_loopback_hosts_pass(host):
    assert _app(Guard.for_server("127.0.0.1")).get("/v1/models", headers={"Host": host}).status_code == 200


def test_allowed_host_and_bound_address():
    guard = Guard.for_server("192.168.1.5", ["mybox.lan"])
    client = _app(guard)
    assert client.get("/v1/models", headers={"Host": "mybox.lan:8000"}).status_code == 200
    assert client.get("/v1/models", headers={"Host": "192.168.1.5:8000"}).status_code == 200
    assert client.get("/v1/models", headers={"Host": "other.lan"}).status_code == 403
    # a wildcard bind adds no name of its own; * answers any
    assert "0.0.0.0" not in Guard.for_server("0.0.0.0").allowed_hosts
    assert _app(Guard.for_server("0.0.0.0", ["*"])).get("/v1/models", headers={"Host": "x.y"}).status_code == 200


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_post_must_be_json(ctype):
    headers = {"Host": "127.0.0.1"} | ({"Content-Type": ctype} if ctype else {})
    r = _app(Guard()).post("/v1/chat/completions", content=b'{"model": "m"}', headers=headers)
    assert r.status_code == 415
    assert r.json()["error"]["code"] == "unsupported_media_type"


def test_json_with_charset_passes():
    r = _app(Guard()).post("/v1/chat/completions", content=b"{}",
                           headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_api_key():
    client = _app(Guard.for_server("127.0.0.1", api_key="s3cret"))
    r = client.get("/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Basic s3cret"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200  # a liveness probe needs no key
    # no key configured: none asked for
    assert _app(Guard()).get("/v1/models").status_code == 200


@pytest.mark.parametrize("field", ["seed", "max_tokens"])
def test_huge_integer_is_a_400(field):
    raw = b'{"model": "m", "' + field.encode() + b'": ' + b"9" * 5000 + b"}"
    with pytest.raises(APIError) as err:
        parse_json_body(raw)
    assert err.value.status == 400


def test_message_chars_counts_text_not_blanks():
    body = {"messages": [{"role": "user", "content": "ab c\n\t d"},
                         {"role": "user", "content": [{"type": "text", "text": "xyz"}, {"type": "image"}]},
                         {"role": "assistant", "content": None}, "junk"]}
    assert message_chars(body) == 4 + 3
    assert message_chars({"messages": "nope"}) == 0
    assert message_chars([1, 2]) == 0


def test_prepare_gate_bounds_work_and_waiting():
    async def scenario() -> tuple[int, int, list[int]]:
        gate = PrepareGate(workers=2, backlog=1)
        inside_max = 0
        running = 0
        release = asyncio.Event()
        statuses: list[int] = []

        async def worker() -> None:
            nonlocal running, inside_max
            try:
                async with gate.enter():
                    running += 1
                    inside_max = max(inside_max, running)
                    await release.wait()
                    running -= 1
            except APIError as exc:
                statuses.append(exc.status)

        tasks = [asyncio.create_task(worker()) for _ in range(5)]
        await asyncio.sleep(0.05)
        waiting_then = gate.inside
        release.set()
        await asyncio.gather(*tasks)
        return inside_max, waiting_then, statuses

    inside_max, admitted, statuses = asyncio.run(scenario())
    assert inside_max == 2          # two at work at once
    assert admitted == 3            # two working + one waiting
    assert statuses == [429, 429]   # the rest refused at once


def test_parse_slots():
    assert parse_slots("auto") == 0 and parse_slots("AUTO") == 0 and parse_slots("3") == 3
    for bad in ("0", "-1", "many"):
        with pytest.raises(PaskError):
            parse_slots(bad)


def test_default_model_is_the_strongest_installed():
    assert PREFERRED_MODELS[0] == "qwen2.5-coder-1.5b"
    assert pick_default_model(lambda n: True) == ("qwen2.5-coder-1.5b", None)
    assert pick_default_model(lambda n: n == "qwen2.5-coder-0.5b") == ("qwen2.5-coder-0.5b", None)
    name, notice = pick_default_model(lambda n: False)
    assert name == DEFAULT_MODEL == "gemma3-270m" and notice and "base model" in notice
    assert pick_default_model(lambda n: True, "gemma3-270m") == ("gemma3-270m", None)
    with pytest.raises(PaskError):
        pick_default_model(lambda n: True, "no-such-model")


def test_error_body_is_json():
    r = _app(Guard()).get("/v1/models", headers={"Host": "evil"})
    assert json.loads(r.text)["error"]["type"] == "invalid_request_error"
