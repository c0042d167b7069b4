"""BFCL's own multi-turn runner (bfcl-eval's OpenAI handler) against the real server on 127.0.0.1.

``scripts/bfcl_client.py`` points ``OpenAICompletionsHandler`` at a ``pask-local serve`` app
(Qwen2.5-Coder-0.5B, Full KV, in a thread) and plays the first turn of one multi_turn_base
conversation: the handler sends its own requests (its message history, ``store``, ``temperature``),
executes what comes back in BFCL's environments, and BFCL's checker gives a verdict. The test pins
that a client we did not write completes a turn against the server (no error in its requests, one
turn of results, the server's request counter moved), not what the small model answers."""

from __future__ import annotations

import importlib.util
import os
import sys
import urllib.request

import pytest
from conftest import REPO
from serve_helpers import serve_in_thread

pytestmark = pytest.mark.slow

SCRIPT = REPO / "scripts" / "bfcl_client.py"


def _script():
    sys.path.insert(0, str(SCRIPT.parent))  # it imports scripts/loopback.py as a script would
    spec = importlib.util.spec_from_file_location("bfcl_client", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _served(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('pask_requests_total{status="200"}'))


def test_bfcl_runner_plays_a_turn_against_the_server(qwen05_path, tmp_path, monkeypatch):
    from pask_local.eval.multiturn import select_conversations
    from pask_local.llm import Model
    from pask_local.server.app import Server, ServerConfig
    from pask_local.server.openai_io import Defaults

    client = _script()
    monkeypatch.setenv("PASK_THREADS", os.environ.get("PASK_THREADS", "1"))
    for var in ("OPENAI_BASE_URL", "OPENAI_API_KEY"):  # run_bfcl sets them for the handler: restored after
        monkeypatch.setenv(var, "unset")
    convs = select_conversations(["multi_turn_base"], "all", ids=["multi_turn_base_100"])  # the smallest tools
    model = Model(qwen05_path)
    srv = Server(model, ServerConfig("qwen-served", Defaults(method="full", max_tokens=64), slots=1,
                                     max_context=8192))
    try:
        with serve_in_thread(srv) as url:
            rows = client.run_bfcl(url, "unused", convs, 1, tmp_path)
            served = _served(url)
    finally:
        srv.close()
        model.close()
    (row,) = rows
    assert row["id"] == "multi_turn_base_100" and row["turns"] == 1
    assert isinstance(row["result"], list) and len(row["result"]) == 1, row["result"]  # one turn, no inference error
    assert row["error_type"] != "multi_turn:inference_error"
    assert served >= 1  # the handler's requests were answered 200
    assert (tmp_path / "bfcl_client.jsonl").read_text().count("\n") == 1  # recorded, so a rerun resumes
