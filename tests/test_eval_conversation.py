"""Conversations in ``eval --dataset``: earlier tool calls and tool results reach the native prompt whole;
bad conversations are one line naming the case."""

from __future__ import annotations

import json

import pytest
from eval_helpers import FN

from pask_local.eval.data import DataError, load_file
from pask_local.eval.prompting import make_task, render_tokens, task_plan

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Berlin"})}}
TURN = [
    {"role": "user", "content": "What is the weather in Berlin?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Berlin: drizzle, 13 degrees"},
    {"role": "user", "content": "And in Paris, in fahrenheit?"},
]
ANSWER = [{"get_weather": {"city": ["Paris"], "unit": ["f"]}}]


def _write(tmp_path, turn, case_id="conv_0"):
    path = tmp_path / "conv.jsonl"
    path.write_text(json.dumps({"id": case_id, "question": [turn], "function": [FN], "ground_truth": ANSWER}) + "\n")
    return path


def test_conversation_loads_whole(tmp_path):
    (case,) = load_file(_write(tmp_path, TURN))
    assert [m["role"] for m in case.messages] == ["user", "assistant", "tool", "user"]
    assert case.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(case.messages[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Berlin"}
    assert case.messages[2]["tool_call_id"] == "call_1"
    assert case.is_conversation and case.answer == ANSWER
    task = make_task(case, use_examples=False)
    assert task.messages is not None and len(task.conversation()) == 4
    # a plain BFCL turn stays the one user message it always was (earlier results stay comparable)
    plain = [{"role": "user", "content": "Weather in Rome?"}]
    (one,) = load_file(_write(tmp_path, plain, "plain_0"))
    assert not one.is_conversation and make_task(one, use_examples=False).messages is None


def test_native_prompt_holds_the_earlier_call_and_its_result(tmp_path, qwen05_path):
    """Before conversations were read whole, the assistant's tool_calls were dropped (its content
    kept, or the entry refused): the prompt never showed the earlier call."""
    from pask_local.engine import EngineConfig
    from pask_local.llm import Model

    (case,) = load_file(_write(tmp_path, TURN))
    model = Model(qwen05_path)
    try:
        task = make_task(case, use_examples=False)
        bounds = EngineConfig()
        p = task_plan(model, task, "native", bounds.max_string, bounds.max_calls)
        text = model.detokenize(p.prompt.tokens, special=True)
        assert render_tokens(model, task, "native") == p.prompt.tokens  # the sizing count is the prompt
    finally:
        model.close()
    assert "Berlin: drizzle, 13 degrees" in text
    call_at = text.index("<|im_start|>assistant\n<tool_call>")  # the earlier call, in Qwen's own format
    call = text[call_at:text.index("</tool_call>", call_at)]
    assert '"name": "get_weather"' in call and '"city": "Berlin"' in call, call
    assert call_at < text.index("Berlin: drizzle") < text.index("And in Paris")
    assert text.rstrip().endswith("<|im_start|>assistant")


@pytest.mark.parametrize("turn,msg", [
    ([TURN[0], TURN[1], {**TURN[2], "tool_call_id": "call_9"}, TURN[3]], "'call_9', which no earlier assistant"),
    ([TURN[0], TURN[2], TURN[3]], "a tool result with no earlier assistant 'tool_calls'"),
    ([TURN[0], {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                     "function": {"name": "get_weather", "arguments": "{city"}}]},
      TURN[3]], "'arguments' of 'get_weather' is not valid JSON"),
    ([TURN[0], {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}, TURN[3]],
     "needs a 'function' object"),
    ([TURN[0], {"role": "assistant", "tool_calls": {"id": "c"}}, TURN[3]], "'tool_calls' must be a list"),
])
def test_bad_conversations_are_one_line_naming_the_case(tmp_path, turn, msg):
    with pytest.raises(DataError) as exc:
        load_file(_write(tmp_path, turn, "bad_case_7"))
    text = str(exc.value)
    assert msg in text and "'bad_case_7'" in text and "\n" not in text, text


@pytest.mark.slow
def test_eval_runs_a_conversation_case_with_full_and_a_budget(tmp_path, qwen05_path, cli):
    out = tmp_path / "res"
    r = cli("eval", "--dataset", str(_write(tmp_path, TURN)), "--gguf", str(qwen05_path), "--methods",
            "full,streaming", "--budgets", "0.5", "--max-tokens", "32", "--prompt-style", "native",
            "--out", str(out), env={"PASK_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in (out / "cases.jsonl").read_text().splitlines()]
    assert {(x["method"], x["budget"]) for x in recs} == {("full", None), ("streaming", 0.5)}
    assert all(x["error_type"] != "generation_error" for x in recs), recs
    full = next(x for x in recs if x["method"] == "full")
    assert full["n_prompt"] > 100  # the whole conversation, not the last user line
