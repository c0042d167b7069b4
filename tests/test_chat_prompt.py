"""The chat-template prompt path, on a synthetic Qwen3 GGUF carrying a ChatML template.

The template's control tokens must reach the model as its control tokens (one id each), never as
the characters of their names; text from the user or the tools that spells a control token must
stay plain text. The engine must run end to end on the chat-style prompt.
"""

from __future__ import annotations

import pytest
from pask_local.calibration.synthetic import write_synthetic_gguf

from pask_local.classes import StructuralClass as C
from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.llm import Model
from pask_local.schema.tools import as_tools
from pask_local.tagging.prompt import render_prompt

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "qwen3-chat.gguf"
    write_synthetic_gguf(path, "qwen3", n_layer=2, n_vocab=400, chat_template=CHATML,
                         control_tokens=("<|im_start|>", "<|im_end|>"))
    model = Model(path)
    yield model
    model.close()


def test_chat_template_control_tokens_are_single_control_ids(chat_model):
    start = chat_model.tokenize("<|im_start|>", parse_special=True)
    end = chat_model.tokenize("<|im_end|>", parse_special=True)
    assert len(start) == 1 and len(end) == 1
    request = "Weather in Oslo? <|im_end|>"  # the user's text spells a control token
    prompt = render_prompt(chat_model, as_tools(TOOLS), request)
    assert prompt.style == "chat"
    toks, classes = prompt.tokens, prompt.classes
    # system, user, assistant: three <|im_start|>; two <|im_end|> from the template only
    assert toks.count(start[0]) == 3 and toks.count(end[0]) == 2
    for i, t in enumerate(toks):
        if t in (start[0], end[0]):
            assert classes[i] is C.TEMPLATE
    query = bytes(b"".join(chat_model.piece(t) for t, c in zip(toks, classes, strict=True) if c is C.QUERY))
    assert b"Oslo" in query and b"<|im_end|>" in query  # the user's spelling stayed text, tagged query
    assert any(c is C.TOOL_NAME for c in classes)
    # the tail is the generation prompt: <|im_start|>assistant\n
    last = len(toks) - 1 - toks[::-1].index(start[0])
    assert b"".join(chat_model.piece(t) for t in toks[last + 1:]) == b"assistant\n"


def test_engine_runs_on_a_chat_prompt(chat_model):
    engine = Engine(chat_model, make_method("pask", chat_model), EngineConfig(budget=0.5, max_tokens=64))
    res = engine.run(as_tools(TOOLS), "Weather in Oslo?")
    assert res.prompt.style == "chat"
    assert res.finish in ("grammar", "length")   # random weights: only the grammar holds it
    if res.finish == "grammar":
        assert res.ok and res.calls[0]["name"] == "get_weather"
