"""The ``tool-relevance`` order (``pask-tools``): tool segments, the lexical score, and what persists.

Oracles: the tool list itself (each segment's name tokens spell that tool's name, in order), the
query (the tool it names ranks first), the hand-written prior (with one tool, ``pask-tools`` must
keep exactly what ``pask-prior`` keeps: the order has nothing to choose between), and the Python
reference rule (the engine's native step must evict as ``Method.select`` does). Prompts are
rendered and tagged by the real renderers and tokenizers (Qwen2.5-Coder-0.5B's own tool protocol,
Gemma 3 270M's instruction prompt).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import evictions

from pask_local.classes import StructuralClass as C
from pask_local.classes import class_index
from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.errors import NativeError
from pask_local.llm import Model
from pask_local.methods import LayerView
from pask_local.methods.pask import class_indices
from pask_local.tagging.relevance import tool_relevance, tool_scores, tool_segments, words

pytestmark = pytest.mark.slow

TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "description": "The city name, e.g. Paris."},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit."}},
         "required": ["city"]}},
    {"name": "calculate_triangle_area", "description": "Calculate the area of a triangle from its base and height.",
     "parameters": {"type": "object", "properties": {
         "base": {"type": "integer", "description": "The base of the triangle."},
         "height": {"type": "integer", "description": "The height of the triangle."},
         "unit": {"type": "string", "description": "The unit of measure of the sides."}},
         "required": ["base", "height"]}},
    {"name": "book_flight", "description": "Book a flight between two airports on a date.",
     "parameters": {"type": "object", "properties": {
         "origin": {"type": "string", "description": "IATA code of the departure airport."},
         "destination": {"type": "string", "description": "IATA code of the arrival airport."},
         "date": {"type": "string", "description": "Departure date, YYYY-MM-DD."}},
         "required": ["origin", "destination", "date"]}},
]
TRIANGLE = "What is the area of a triangle with base 4 and height 6?"
_DETAIL = [class_index(c) for c in (C.DESCRIPTION, C.PARAM_NAME, C.PARAM_TYPE)]


@pytest.fixture(scope="module")
def qwen(qwen05_model) -> Model:
    return qwen05_model


@pytest.fixture(scope="module")
def gemma(gemma_model) -> Model:
    return gemma_model


def tagged(model: Model, query: str | list, tools=TOOLS):
    messages = [{"role": "user", "content": query}] if isinstance(query, str) else query
    prompt = Engine(model, make_method("full", model)).prepare(messages, tools, "required").plan.prompt
    pieces = [model.piece(t).decode("utf-8", "replace") for t in prompt.tokens]
    return prompt, pieces, class_indices(prompt.classes)


@pytest.mark.parametrize("which", ["qwen", "gemma"])
def test_segments_follow_the_tool_entries(which, request):
    model = request.getfixturevalue(which)
    _, pieces, cls = tagged(model, TRIANGLE)
    seg = tool_segments(cls)
    assert seg.max() + 1 == len(TOOLS)
    for t, tool in enumerate(TOOLS):
        name = "".join(p for p, s, c in zip(pieces, seg, cls, strict=True) if s == t and c == class_index(C.TOOL_NAME))
        assert tool["name"] in name
        described = "".join(p for p, s, c in zip(pieces, seg, cls, strict=True)
                            if s == t and c == class_index(C.DESCRIPTION))
        assert tool["description"].split()[1] in described  # the tool's own description, not a neighbour's
    outside = {int(c) for c, s in zip(cls, seg, strict=True) if s < 0}
    assert class_index(C.QUERY) in outside and class_index(C.DESCRIPTION) not in outside


@pytest.mark.parametrize("query, best", [(TRIANGLE, 1), ("Weather in Oslo in fahrenheit?", 0),
                                         ("Book me a flight from OSL to CDG on 2026-12-24", 2)])
def test_the_tool_the_query_names_ranks_first(qwen, query, best):
    _, pieces, cls = tagged(qwen, query)
    seg, scores = tool_scores(pieces, cls)
    assert int(np.argmax(scores)) == best
    rel = tool_relevance(pieces, cls)
    assert np.all(rel[seg == best] == 1.0)
    assert all(rel[seg == t].max() < 0.5 for t in range(len(TOOLS)) if t != best)
    assert np.all(rel[seg < 0] == 1.0)


def test_no_preference_without_a_choice_or_a_shared_word(qwen):
    _, pieces, cls = tagged(qwen, TRIANGLE, tools=TOOLS[1:2])
    assert np.all(tool_relevance(pieces, cls) == 1.0)  # one tool
    _, pieces, cls = tagged(qwen, "Hello there, how are you?")
    assert np.all(tool_relevance(pieces, cls) == 1.0)  # no word shared with any tool


def test_a_tool_named_in_an_earlier_call_is_not_a_tool_entry(qwen):
    conversation = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C, snow"},
        {"role": "user", "content": TRIANGLE},
    ]
    _, pieces, cls = tagged(qwen, conversation)
    assert tool_segments(cls).max() + 1 == len(TOOLS)


def test_words_split_names_and_drop_filler():
    assert words("calculate_triangleArea of the Triangles, 42") == {"calcul", "triang", "area"}


def detail_kept(plan, cls, budget_cap: int) -> list[int]:
    """Per tool: how many of its description, parameter-name and type tokens layer 0 keeps (``plan``:
    a PASK method bound to the prompt)."""
    pos = np.arange(len(cls))
    view = LayerView(layer=0, n_layer=plan.method.policy.n_layer, positions=pos, classes=cls, prompt_len=len(cls),
                     all_classes=cls)
    kept = np.zeros(len(cls), dtype=bool)
    kept[plan.select(view, budget_cap)] = True
    seg = tool_segments(cls)
    detail = np.isin(cls, _DETAIL)
    return [int(kept[(seg == t) & detail].sum()) for t in range(seg.max() + 1)]


def test_pask_tools_keeps_the_named_tool_before_the_others(qwen):
    _, pieces, cls = tagged(qwen, TRIANGLE)
    fractions = {}
    for name in ("pask-tools", "pask-prior"):
        plan = make_method(name, qwen).bind(0.3, cls, qwen.n_layer, pieces)
        fractions[name] = detail_kept(plan, cls, plan.capacities[0])
    tools, prior = fractions["pask-tools"], fractions["pask-prior"]
    assert tools[1] > tools[0] and tools[1] > tools[2]  # the triangle tool's details persist first
    assert tools[1] > prior[1]  # where the prior spreads the same room over every tool
    assert sum(tools) == sum(prior)  # the same class quotas: the room moved between tools, none was added


def test_pask_tools_equals_the_prior_with_one_tool(qwen):
    """With one tool the order has no choice: pask-tools keeps and generates what pask-prior does."""
    out = {}
    for name in ("pask-tools", "pask-prior"):
        engine = Engine(qwen, make_method(name, qwen), EngineConfig(budget=0.2, max_tokens=40))
        out[name] = engine.run(TOOLS[1:2], TRIANGLE)
    assert out["pask-tools"].tokens == out["pask-prior"].tokens
    assert out["pask-tools"].stats["held_per_group"] == out["pask-prior"].stats["held_per_group"]


@pytest.mark.slow
def test_engine_native_step_evicts_as_the_python_rule(gemma, tmp_path):
    """pask-tools on three tools: the native step (priorities uploaded once) makes the Python rule's
    evictions, step by step, and the same tokens (one process)."""
    runs = {}
    for native in (False, True):
        cfg = EngineConfig(budget=0.2, max_tokens=40, native_step=native, hysteresis=0.0, compact=False)
        trace = tmp_path / f"native-{native}.jsonl"
        res = Engine(gemma, make_method("pask-tools", gemma), cfg).run(TOOLS, TRIANGLE, trace=trace)
        runs[native] = (res, evictions(trace))
    (ref, ev_ref), (nat, ev_nat) = runs[False], runs[True]
    assert any(k[0] >= 0 for k in ev_ref), "no eviction while decoding: the check would be empty"
    assert ev_nat == ev_ref
    assert nat.tokens == ref.tokens


def test_step_refuses_priorities_of_the_wrong_length(qwen):
    engine = Engine(qwen, make_method("pask-tools", qwen), EngineConfig(budget=0.3, max_tokens=8))
    prepared = engine.prepare([{"role": "user", "content": TRIANGLE}], TOOLS, "required")
    r = engine.new_run(prepared)
    try:
        with pytest.raises(NativeError, match="one priority per prompt position"):
            r.evictor.step.set_priority(np.zeros(prepared.n_prompt - 1))
        with pytest.raises(NativeError, match="not finite"):
            r.evictor.step.set_priority(np.full(prepared.n_prompt, np.nan))
    finally:
        r.close()
