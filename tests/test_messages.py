"""The OpenAI-style message model and tool_choice: valid conversations parse, bad ones are one-line
errors naming the message index; the reply has OpenAI's shape (ids call_..., arguments as JSON strings)."""

from __future__ import annotations

import json

import pytest

from pask_local.chat.result import AssistantMessage
from pask_local.errors import PaskError
from pask_local.messages import MessageError, ToolChoice, parse_messages, parse_tool_choice

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Oslo"}'}}
CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 3}'},
    {"role": "user", "content": "And Paris?"},
]


def test_a_conversation_parses() -> None:
    msgs = parse_messages(CONVO)
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert msgs[1].content == "Weather in Oslo?"
    call = msgs[2].tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call_1", "get_weather", {"location": "Oslo"})
    assert msgs[3].tool_call_id == "call_1"


@pytest.mark.parametrize("change,index,words", [
    (lambda c: c.__setitem__(3, {**c[3], "tool_call_id": "call_9"}), 3, "no earlier assistant"),
    (lambda c: c.__setitem__(1, {"role": "robot", "content": "x"}), 1, "unknown role"),
    (lambda c: c.__setitem__(4, {"role": "user", "content": 7}), 4, "must be a string"),
    (lambda c: c.__setitem__(2, {"role": "assistant", "content": None}), 2, "needs 'content' or 'tool_calls'"),
    (lambda c: c.__setitem__(2, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": "{oops"}}]}), 2, "not valid JSON"),
    (lambda c: c.__setitem__(2, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}), 2, "'id'"),
    (lambda c: c.__setitem__(3, "hello"), 3, "must be an object"),
    (lambda c: c.append({"role": "assistant", "content": "hi"}), 5, "nothing to answer"),
])
def test_bad_messages_are_one_line_errors_naming_the_index(change, index: int, words: str) -> None:
    convo = json.loads(json.dumps(CONVO))
    change(convo)
    with pytest.raises(MessageError) as err:
        parse_messages(convo)
    text = str(err.value)
    assert isinstance(err.value, PaskError) and "\n" not in text
    assert f"messages[{index}]" in text and words in text


def test_a_tool_result_before_its_call_is_refused() -> None:
    convo = [CONVO[1], CONVO[3], CONVO[2], CONVO[4]]   # the result comes before the call
    with pytest.raises(MessageError, match=r"messages\[1\]: tool result references call id 'call_1'"):
        parse_messages(convo)


def test_empty_or_non_list_messages() -> None:
    for bad in ([], {"role": "user"}, "hi"):
        with pytest.raises(MessageError, match="non-empty JSON list"):
            parse_messages(bad)


def test_tool_choice_forms() -> None:
    names = ["get_weather", "get_time"]
    assert parse_tool_choice("auto", names) == ToolChoice("auto")
    assert parse_tool_choice("none", names).calls is False
    assert parse_tool_choice("required", names).calls is True
    named = parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, names)
    assert named == ToolChoice("function", "get_time") and named.calls
    assert parse_tool_choice('{"type": "function", "function": {"name": "get_weather"}}', names).name == "get_weather"
    with pytest.raises(MessageError, match="'nope', which is not among the tools"):
        parse_tool_choice({"type": "function", "function": {"name": "nope"}}, names)
    for bad in ("sometimes", {"type": "function"}, 3, "{bad json"):
        with pytest.raises(MessageError):
            parse_tool_choice(bad, names)


def test_reply_has_openai_shape() -> None:
    reply = AssistantMessage.from_calls([{"name": "get_weather", "arguments": {"location": "Paris", "n": 2}},
                                         {"name": "get_time", "arguments": {}}])
    out = reply.to_openai()
    assert out["role"] == "assistant" and out["content"] is None and reply.finish_reason == "tool_calls"
    ids = [c["id"] for c in out["tool_calls"]]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    fn = out["tool_calls"][0]["function"]
    assert isinstance(fn["arguments"], str) and json.loads(fn["arguments"]) == {"location": "Paris", "n": 2}
    # a reply parses back as an assistant message of a later turn
    again = parse_messages([CONVO[1], out, {"role": "tool", "tool_call_id": ids[0], "content": "ok"}])
    assert again[1].tool_calls[0].arguments == {"location": "Paris", "n": 2}
    text = AssistantMessage("Hello.").to_openai()
    assert text == {"role": "assistant", "content": "Hello."}
