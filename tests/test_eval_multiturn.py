"""BFCL multi-turn loop on bfcl-eval's real environments and checker (no mocks of BFCL).

A caller replaying BFCL's ground truth must score 100% and one that never calls must score 0
(the loop and the scores can fail); environment errors and unknown functions come back as tool
messages; a rerun skips recorded conversations; one smoke run on the real 0.5B model (slow).
"""

from __future__ import annotations

import ast
import json
from typing import Any

import jsonschema
import pytest

pytest.importorskip("bfcl_eval")

from pask_local.eval.multiturn import (  # noqa: E402
    ERROR_PREFIX,
    markdown,
    openai_tools,
    run_conversation,
    run_multiturn,
    summarize,
)
from pask_local.eval.multiturn_env import Conversation, MultiTurnError, call_string, load_conversations  # noqa: E402


def _conv(category: str, index: int = 0) -> Conversation:
    return load_conversations(category)[index]


def _parse_truth(text: str, conv: Conversation) -> dict[str, Any]:
    """A ground-truth call string -> {name, arguments}; positional arguments named in the doc's order."""
    call = ast.parse(text, mode="eval").body
    assert isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
    docs = {f["name"]: f for f in conv.functions + [f for fs in conv.held_out.values() for f in fs]}
    order = list(docs[call.func.id]["parameters"]["properties"])
    args = {order[i]: ast.literal_eval(a) for i, a in enumerate(call.args)}
    args.update({k.arg: ast.literal_eval(k.value) for k in call.keywords})
    return {"name": call.func.id, "arguments": args}


def _turn_and_step(messages: list[dict]) -> tuple[int, int]:
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    step = sum(m["role"] == "assistant" for m in messages[users[-1]:])
    return len(users) - 1, step


def replay_caller(conv: Conversation):
    """Answers turn k with BFCL's ground-truth calls of turn k (one step), then with text."""

    def caller(messages: list[dict], tools: list[dict]) -> dict:
        turn, step = _turn_and_step(messages)
        truth = conv.ground_truth[turn]
        if step > 0 or not truth:
            return {"role": "assistant", "content": "Done."}
        calls = [_parse_truth(t, conv) for t in truth]
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{turn}_{j}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
            for j, c in enumerate(calls)]}

    return caller


def silent_caller(messages: list[dict], tools: list[dict]) -> dict:
    return {"role": "assistant", "content": "I will not call anything."}


def scripted_caller(calls: list[dict], seen: list[list[dict]]):
    """Step 0 of every turn: ``calls``; then text. Records the messages of every request in ``seen``."""

    def caller(messages: list[dict], tools: list[dict]) -> dict:
        seen.append(messages)
        _, step = _turn_and_step(messages)
        if step > 0:
            return {"role": "assistant", "content": "ok"}
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"x{j}", "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for j, c in enumerate(calls)]}

    return caller


@pytest.mark.parametrize("category,index", [("multi_turn_base", 0), ("multi_turn_base", 1), ("multi_turn_base", 2),
                                            ("multi_turn_miss_param", 0), ("multi_turn_miss_func", 0),
                                            ("multi_turn_long_context", 0)])
def test_ground_truth_replay_scores_full(category, index):
    conv = _conv(category, index)
    rec = run_conversation(conv, replay_caller(conv))
    assert rec["correct"], rec["checker"]
    assert rec["turn_correct"] == [True] * len(conv.turns)
    assert rec["n_turns_run"] == len(conv.turns) and not rec["force_quit"] and rec["error"] is None
    assert [len(t["executed"]) for t in rec["turns"]] == [1 if gt else 0 for gt in conv.ground_truth]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_no_calls_scores_zero(index):
    conv = _conv("multi_turn_base", index)
    rec = run_conversation(conv, silent_caller)
    assert not rec["correct"]
    assert rec["checker"]["error_type"] == "multi_turn:empty_turn_model_response"
    assert rec["turn_correct"] == [False] * len(conv.turns)
    assert rec["n_steps"] == len(conv.turns) and rec["n_calls"] == 0


def test_miss_func_offers_held_out_function_at_its_turn():
    conv = _conv("multi_turn_miss_func")
    (turn, held), = conv.held_out.items()
    offered: list[set[str]] = []

    def caller(messages, tools):
        offered.append({t["function"]["name"] for t in tools})
        return silent_caller(messages, tools)

    run_conversation(conv, caller)
    names = {f["name"] for f in held}
    assert all(not (names & o) for o in offered[:turn]) and all(names <= o for o in offered[turn:])


def test_call_that_raises_becomes_a_tool_error():
    conv = _conv("multi_turn_base")  # GorillaFileSystem: cd() has no such argument -> TypeError inside BFCL
    seen: list[list[dict]] = []
    rec = run_conversation(conv, scripted_caller([{"name": "cd", "arguments": '{"no_such_arg": "x"}'}], seen),
                           max_turns=1)
    tool_msgs = [m for m in seen[1] if m["role"] == "tool"]
    assert len(tool_msgs) == 1 and tool_msgs[0]["tool_call_id"] == "x0"
    assert tool_msgs[0]["content"].startswith(ERROR_PREFIX) and "no_such_arg" in tool_msgs[0]["content"]
    assert rec["n_tool_errors"] == 1 and not rec["correct"] and rec["turn_correct"] == [False]
    assert rec["turns"][0]["executed"] == [["cd(no_such_arg='x')"]]  # it ran (and raised) in the environment


def test_unknown_function_and_bad_arguments_are_fed_back():
    conv = _conv("multi_turn_base")
    seen: list[list[dict]] = []
    calls = [{"name": "__import__", "arguments": '{"name": "os"}'},
             {"name": "cd", "arguments": '{"folder": "document"'},               # not JSON
             {"name": "cd", "arguments": json.dumps({"folder=1)#": "x"})},        # not an identifier
             {"name": "pwd", "arguments": "{}"}]
    rec = run_conversation(conv, scripted_caller(calls, seen), max_turns=1)
    tool = [m for m in seen[1] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool] == ["x0", "x1", "x2", "x3"]
    assert "unknown function '__import__'" in tool[0]["content"]
    assert all(m["content"].startswith(ERROR_PREFIX) for m in tool[:3])
    assert not tool[3]["content"].startswith(ERROR_PREFIX)            # the valid call ran
    assert rec["turns"][0]["executed"] == [["pwd()"]] and rec["n_tool_errors"] == 3
    assistant = next(m for m in seen[1] if m["role"] == "assistant")  # the history stays a valid conversation
    assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in assistant["tool_calls"])


def test_call_string_refuses_code():
    assert call_string("cd", {"folder": "a'b"}) == "cd(folder=\"a'b\")"
    for name, args in [("os.system", {}), ("cd", {"a b": 1}), ("cd", {"lambda": 1}), ("cd", [1])]:
        with pytest.raises(MultiTurnError):
            call_string(name, args)


def test_step_limit_force_quits():
    conv = _conv("multi_turn_base")

    def always_pwd(messages, tools):
        return {"role": "assistant", "content": None,
                "tool_calls": [{"id": f"p{len(messages)}", "type": "function",
                                "function": {"name": "pwd", "arguments": "{}"}}]}

    rec = run_conversation(conv, always_pwd, max_steps=2)
    assert rec["force_quit"] and rec["n_turns_run"] == 1 and rec["n_steps"] == 3  # BFCL: quits once steps > limit
    assert not rec["correct"] and rec["checker"]["error_type"] == "multi_turn:force_terminated"
    assert rec["turn_correct"][1:] == [False] * (len(conv.turns) - 1)


def test_resume_skips_recorded_conversations(tmp_path):
    convs = load_conversations("multi_turn_base")[:2]
    out = tmp_path / "mt"
    lines: list[str] = []
    first = run_multiturn(convs, silent_caller, out, method="silent", log=lines.append)
    assert len(first) == 2 and len(lines) == 2
    asked = []

    def counting(messages, tools):
        asked.append(1)
        return silent_caller(messages, tools)

    again = run_multiturn(convs, counting, out, method="silent", log=lines.append)
    assert not asked and [r["id"] for r in again] == [c.id for c in convs]
    assert len((out / "cases.jsonl").read_text().splitlines()) == 2
    summary = summarize(again)
    assert summary["categories"]["multi_turn_base"]["conversations"] == 2
    assert "| multi_turn_base | 2 | 0.0% |" in markdown(summary)


@pytest.mark.parametrize("kwargs,message", [
    ({"categories": "multi_turn_web"}, "unknown multi-turn category"),
    ({"method": "nope"}, "unknown method"),
    ({"max_steps": 0}, "--max-steps"),
    ({"ids": "multi_turn_base_99999", "split": "all"}, "no conversation 'multi_turn_base_99999'"),
])
def test_command_bad_input_is_one_line(kwargs, message, tmp_path):
    from pask_local.errors import PaskError
    from pask_local.eval.multiturn_cli import multiturn_command

    with pytest.raises(PaskError, match=message) as info:
        multiturn_command(**{"out": tmp_path / "o", **kwargs})
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_qwen05_smoke(tmp_path, qwen05_path):
    from pask_local.eval.multiturn import engine_caller

    conv = load_conversations("multi_turn_base")[0]
    caller, close = engine_caller(qwen05_path, method="full", max_tokens=96)
    try:
        # one turn, at most two requests: each request prefills the ~4.8k-token tool list anew (minutes on 1 CPU)
        records = run_multiturn([conv], caller, tmp_path / "mt", method="full", max_steps=1, max_turns=1,
                                log=None)
    finally:
        close()
    rec = json.loads((tmp_path / "mt" / "cases.jsonl").read_text().splitlines()[0])
    assert rec == records[0] and rec["id"] == conv.id and rec["error"] is None
    assert rec["n_turns"] == 1 and len(rec["turn_correct"]) == 1 and 1 <= rec["n_steps"] <= 2
    assert rec["n_turns_run"] == 1 and isinstance(rec["correct"], bool)
    assert rec["prompt_tokens"] > 0
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in openai_tools(conv.functions)}
    for turn in rec["turns"]:
        for step in turn["calls"]:
            for call in step:   # the engine's grammar: every call names a tool and validates
                jsonschema.validate(call["arguments"], schemas[call["name"]])
