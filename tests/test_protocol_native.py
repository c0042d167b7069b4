"""The native tool-call protocol on synthetic GGUFs carrying tools templates written for these tests.

Detection: a template with a tools branch and Hermes-style ``<tool_call>`` output is native; one
without a tools branch, or one that lists tools in a form we cannot locate, falls back to the
instruction prompt. Tagging: every structural class is found inside the template's rendering.
Generation: the grammar holds the native format for required / named / parallel calls, ``none``
never opens a call, and ``auto`` engages the grammar when the call opener is generated.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from grammar_helpers import gemma
from pask_local.calibration.synthetic import write_synthetic_gguf

from pask_local.chat.decoder import Decoder
from pask_local.chat.protocol import plan
from pask_local.classes import StructuralClass as C
from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.errors import PaskError
from pask_local.grammar.state import GrammarState
from pask_local.llm import Model
from pask_local.messages import ToolChoice, parse_messages, user_message
from pask_local.schema.gbnf import build_native_grammar
from pask_local.schema.tools import load_tools
from pask_local.tagging.generated import CallTagger
from pask_local.tagging.native import call_format
from pask_local.tagging.template import ChatTemplateError

# A tools template in the Hermes style, written for this test (tools indented by 2, one per line).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "Functions:\n{% for t in tools %}{{ t | tojson(indent=2) }}\n{% endfor %}"
    "Answer with <tool_call> blocks.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{% if not tools %}<|im_start|>system\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{% for c in m.tool_calls %}\n<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NO_TOOLS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NAMES_ONLY_TEMPLATE = ("{% if tools %}Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
                       + NO_TOOLS_TEMPLATE)
RAISES_ON_TOOL_ROLE = TOOLS_TEMPLATE.replace(
    "{% elif m.role == 'tool' %}", "{% elif m.role == 'tool' %}{{ raise_exception('tool messages are not supported') }}")
CONTROL = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
TOOLS = load_tools([
    {"name": "get_weather", "description": "Weather report",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "description": "City name"},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}},
    {"name": "get_time", "description": "Local time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}},
])
CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "minus three, snowing"},
    {"role": "user", "content": "And in Lima?"},
]


def _model(tmp_path_factory, template: str, name: str) -> Model:
    path = tmp_path_factory.mktemp("native") / f"{name}.gguf"
    write_synthetic_gguf(path, "qwen3", n_layer=2, n_vocab=400, n_ctx=2048, chat_template=template,
                         control_tokens=CONTROL)
    return Model(path)


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    m = _model(tmp_path_factory, TOOLS_TEMPLATE, "tools")
    yield m
    m.close()


def test_call_format_detection() -> None:
    fmt = call_format(TOOLS_TEMPLATE)
    assert fmt is not None and fmt.trigger == "<tool_call>"
    assert call_format(NO_TOOLS_TEMPLATE) is None      # no tools branch
    assert call_format(NAMES_ONLY_TEMPLATE) is None    # tools branch, but no locatable definitions


def _token_text(model: Model, prompt) -> tuple[bytes, list[tuple[int, int]]]:
    spans, pos, text = [], 0, b""
    for t in prompt.tokens:
        p = model.piece(t)
        spans.append((pos, pos + len(p)))
        pos += len(p)
        text += p
    return text, spans


def classes_of(model: Model, prompt, needle: str, nth: int = 0) -> set[str]:
    """Classes of the tokens covering the ``nth`` occurrence of ``needle`` in the prompt's tokens."""
    text, spans = _token_text(model, prompt)
    at = -1
    for _ in range(nth + 1):
        at = text.index(needle.encode(), at + 1)
    end = at + len(needle.encode())
    return {c.value for (a, b), c in zip(spans, prompt.classes, strict=True) if a < end and b > at}


def test_native_prompt_tags_every_class(tools_model) -> None:
    m = tools_model
    p = plan(m, TOOLS, parse_messages(CONVO), ToolChoice("auto")).prompt
    assert p.style == "native" and len(p.tokens) == len(p.classes)
    text, _ = _token_text(m, p)
    assert b'{\n  "type": "function",\n  "function": {\n    "name": "get_weather"' in text   # indent=2 found
    assert classes_of(m, p, "get_weather") == {"tool_name"}
    assert classes_of(m, p, "get_time") == {"tool_name"}
    assert classes_of(m, p, "city") == {"param_required"}
    assert classes_of(m, p, "unit") == {"param_name"}
    assert classes_of(m, p, "fahrenheit") == {"param_type"}
    assert classes_of(m, p, "Weather report") == {"description"}
    assert classes_of(m, p, "Be brief.") == {"query"}
    assert classes_of(m, p, "Weather in Oslo?") == {"query"}
    assert classes_of(m, p, "And in Lima?") == {"query"}
    assert classes_of(m, p, "minus three, snowing") == {"tool_result"}
    assert classes_of(m, p, "Functions:") == {"template"}
    # the earlier call: its name is a tool name, its arguments the conversation's content
    assert classes_of(m, p, "get_weather", nth=1) == {"tool_name"}
    assert classes_of(m, p, '{"city": "Oslo"}') == {"query"}
    # control tokens of the template are single control ids tagged template
    for tok in ("<|im_start|>", "<tool_call>"):
        tid = m.tokenize(tok, parse_special=True)
        assert len(tid) == 1 and tid[0] in p.tokens
        assert {p.classes[i] for i, t in enumerate(p.tokens) if t == tid[0]} == {C.TEMPLATE}
    assert p.tokens[0] == m.bos and p.classes[0] is C.SINK        # this GGUF asks for BOS


def test_fallback_to_instruction_prompt(tmp_path_factory) -> None:
    m = _model(tmp_path_factory, NO_TOOLS_TEMPLATE, "notools")
    try:
        p = plan(m, TOOLS, user_message("Weather in Oslo?"), ToolChoice("required"))
        assert p.fmt is None and p.prompt.style == "chat"
        assert any(c is C.TOOL_NAME for c in p.prompt.classes)
        with pytest.raises(PaskError, match="no tool-call protocol"):
            plan(m, TOOLS, user_message("Weather?"), ToolChoice("required"), style="native")
    finally:
        m.close()


def test_a_template_that_raises_is_one_line_error(tmp_path_factory) -> None:
    m = _model(tmp_path_factory, RAISES_ON_TOOL_ROLE, "raises")
    try:
        with pytest.raises(ChatTemplateError) as err:
            plan(m, TOOLS, parse_messages(CONVO), ToolChoice("auto"))
        assert "tool messages are not supported" in str(err.value) and "\n" not in str(err.value)
    finally:
        m.close()


L = {"S": C.GEN_STRUCT, "N": C.GEN_NAME, "K": C.GEN_KEY, "R": C.GEN_VALUE_REQUIRED, "O": C.GEN_VALUE_OPTIONAL,
     "W": C.GEN_WS}


def test_native_grammar_and_generated_classes() -> None:
    """Two parallel native blocks through the real grammar and the tagger (Gemma's tokenizer)."""
    m = gemma()
    g = build_native_grammar(TOOLS, "<tool_call>\n", "\n</tool_call>", "\n", parallel=True, max_calls=4)
    blocks = ['{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}',
              '{"name": "get_time", "arguments": {"zone": "CET"}}']
    text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
    st = GrammarState(m.vocab, g.text)
    tagger = CallTagger(m, g, st)
    got = [(m.piece(t).decode(), tagger.accept(t, m.piece(t))) for t in m.tokenize(text, parse_special=False)]
    assert st.can_end()
    by_class: dict[C, str] = {}
    for piece, cls in got:
        by_class[cls] = by_class.get(cls, "") + piece
    assert by_class[C.GEN_NAME] == "get_weatherget_time"
    assert by_class[C.GEN_KEY] == "cityunitzone"
    assert by_class[C.GEN_VALUE_REQUIRED] == "OsloCET"
    assert by_class[C.GEN_VALUE_OPTIONAL] == "celsius"
    assert "tool_call" in by_class[C.GEN_STRUCT]
    # one block only without parallel; an unknown tool never
    single = build_native_grammar(TOOLS, "<tool_call>\n", "\n</tool_call>", "\n")
    st2 = GrammarState(m.vocab, single.text)
    for t in m.tokenize(f"<tool_call>\n{blocks[0]}\n</tool_call>", parse_special=False):
        st2.accept(t)
    assert st2.is_done()
    st3 = GrammarState(m.vocab, single.text)
    bad = m.tokenize('<tool_call>\n{"name": "rm_rf"', parse_special=False)
    ok = True
    for t in bad:
        if not st3.accepts(t):
            ok = False
            break
        st3.accept(t)
    assert not ok


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_engine_native_calls(tools_model, choice) -> None:
    engine = Engine(tools_model, make_method("full", tools_model), EngineConfig(budget=1.0, max_tokens=160,
                                                                                 max_string=8))
    res = engine.chat(CONVO, TOOLS, choice, parallel=True)
    assert res.prompt.style == "native"
    assert res.finish in ("grammar", "eog", "length")   # random weights: only the grammar holds the text
    assert res.text.startswith("<tool_call>\n{\"name\": \"")
    if res.finish != "length":
        assert res.ok, res.error
        names = {c.name for c in res.message.tool_calls}
        assert names <= ({"get_time"} if isinstance(choice, dict) else {"get_weather", "get_time"}) and names
        for call in res.message.to_openai()["tool_calls"]:
            assert call["id"].startswith("call_") and isinstance(json.loads(call["function"]["arguments"]), dict)


def test_engine_tool_choice_none_never_opens_a_call(tools_model) -> None:
    engine = Engine(tools_model, make_method("full", tools_model), EngineConfig(budget=1.0, max_tokens=24))
    res = engine.chat(CONVO, TOOLS, "none")
    opener = tools_model.tokenize("<tool_call>", parse_special=True)[0]
    assert opener not in res.tokens and not res.message.tool_calls and res.ok
    assert res.message.content == (res.text.strip() or None)


def test_auto_engages_the_grammar_at_the_opener(tools_model) -> None:
    m = tools_model
    p = plan(m, TOOLS, parse_messages(CONVO), ToolChoice("auto"))
    dec = Decoder(m, p)
    try:
        for t in m.tokenize("Let me check.", parse_special=False):
            assert dec.accept(t) is C.GEN_VALUE_OPTIONAL and not dec.constrained
        assert dec.accept(m.tokenize("<tool_call>", parse_special=True)[0]) is C.GEN_STRUCT
        assert dec.constrained
        # from now on only the native call can follow: a token the grammar rejects is never chosen
        logits = np.zeros(m.n_vocab, dtype=np.float32)
        end = m.tokenize("<|im_end|>", parse_special=True)[0]
        logits[end] = 100.0
        tok = dec.choose(logits)
        assert tok != end and dec.state is not None and m.piece(tok) == b"\n"
    finally:
        dec.close()
    parsed = p.parse('Let me check.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
                     "grammar", 64)
    assert parsed.error is None and parsed.message.content == "Let me check."
    assert [(c.name, c.arguments) for c in parsed.message.tool_calls] == [("get_time", {"zone": "UTC"})]
