"""The method registry and the per-request plan (``methods.registry``, ``Method.bind``).

Every registered name builds and declares what its entry says; each name is defined in one module;
one method object serves two interleaved requests exactly as two separate objects do (no
per-request state on the method); and the query-agnostic flag matches behaviour: a query-agnostic
method evicts the same prompt positions while prefilling two questions of equal tokens' classes,
a query-aware one does not.
"""

from __future__ import annotations

import re
from itertools import zip_longest

import pytest
from conftest import REPO, evictions

from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.engine.run import Run, alone_steps
from pask_local.errors import PaskError
from pask_local.llm import Model
from pask_local.methods import PASK, PrefillMode, registry
from pask_local.schema.tools import read_tools

pytestmark = pytest.mark.slow

# three tools, so that the question's words can point to one of them (pask-tools)
TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "description": "The city name, e.g. Paris."},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit."}},
         "required": ["city"]}},
    {"name": "calculate_triangle_area", "description": "Calculate the area of a triangle from its base and height.",
     "parameters": {"type": "object", "properties": {
         "base": {"type": "integer", "description": "The base of the triangle."},
         "height": {"type": "integer", "description": "The height of the triangle."}},
         "required": ["base", "height"]}},
    {"name": "book_flight", "description": "Book a flight between two airports on a date.",
     "parameters": {"type": "object", "properties": {
         "origin": {"type": "string", "description": "IATA code of the departure airport."},
         "destination": {"type": "string", "description": "IATA code of the arrival airport."}},
         "required": ["origin", "destination"]}},
]
# equal token counts and classes on Gemma 3 270M (checked below), different words
QUESTIONS = ("What is the area of a triangle with base 4 and height 6?",
             "What is the weather of a flight with base 4 and height 6?")


@pytest.fixture(scope="module")
def model(gemma_model) -> Model:
    return gemma_model


def test_every_registered_name_builds_as_its_entry_says(model):
    for entry in registry.ENTRIES:
        m = make_method(entry.name, model)
        assert m.name == entry.name
        assert m.prefill_mode == entry.prefill_mode, entry.name
        if isinstance(m, PASK):
            assert m.order.query_aware == entry.query_aware, entry.name
        else:  # a baseline reads no text: it is query-aware exactly when it ranks by attention
            assert m.needs_attention == entry.query_aware, entry.name
        assert entry.help and entry.why and "\n" not in entry.help
        if not entry.takes_policy:
            with pytest.raises(PaskError, match="policy"):
                make_method(entry.name, model, REPO / "does-not-matter.json")
    assert registry.DEFAULT_POLICY_METHODS == ("pask", "pask-attn", "pask-tools")
    assert registry.POLICY_METHODS == ("pask", "pask-attn", "pask-hybrid", "pask-tools")
    assert registry.QUERY_AGNOSTIC == ("full", "streaming", "pask", "pask-prior", "floors-only", "snapkv-prefix", "kvzip",
                                       "pask-zip", "knorm", "keydiff")
    with pytest.raises(PaskError, match="unknown method 'nope'"):
        registry.get("nope")


def test_method_names_are_defined_in_one_module():
    assert len(set(registry.METHOD_NAMES)) == len(registry.METHOD_NAMES)
    # the names that are only method names (not also a common word or a JSON key) appear as a string
    # literal in the registry alone
    distinctive = [n for n in registry.METHOD_NAMES if n not in ("full", "pask", "streaming")]
    for path in (REPO / "pask_local").rglob("*.py"):
        if path.name == "registry.py":
            continue
        text = path.read_text()
        for name in distinctive:
            assert not re.search(rf"[\"']{re.escape(name)}[\"']", text), f"{name} defined again in {path}"


def _drive(run: Run, prepared):
    """``Engine.execute``'s driver as a generator: yields after every decode, returns the result."""
    run.begin(prepared.plan, prepared.request)
    return (yield from alone_steps(run))


def _summary(res, trace) -> tuple:
    keys = ("held_per_group", "capacity_per_layer", "budget_used_after_prefill", "budget_used_final",
            "peak_prefill_entries", "warnings")
    return res.tokens, res.text, [res.stats[k] for k in keys], evictions(trace)


@pytest.mark.parametrize(("name", "native"), [("pask-prior", True), ("pask-tools", False), ("pask-hybrid", True)])
def test_one_method_object_serves_interleaved_requests(model, tmp_path, name, native):
    """Two requests (other prompts, other budgets) on ONE method object, both sized before either
    runs and then stepped in turn, give what two separate method objects give: fails if a request's
    quotas, tail or priorities live on the method."""
    jobs = [(read_tools(REPO / "examples" / "get_weather.json"), QUESTIONS[0], 0.33),
            (TOOLS, "Add a calendar entry? No: what is the weather in Paris?", 0.15)]
    alone = []
    for k, (tools, question, budget) in enumerate(jobs):
        cfg = EngineConfig(budget=budget, max_tokens=24, native_step=native)
        engine = Engine(model, make_method(name, model), cfg)
        trace = tmp_path / f"alone-{k}.jsonl"
        res = engine.execute(engine.prepare([{"role": "user", "content": question}], tools, "required"), trace)
        alone.append(_summary(res, trace))
    shared = make_method(name, model)
    runs, gens = [], []
    try:
        for k, (tools, question, budget) in enumerate(jobs):
            engine = Engine(model, shared, EngineConfig(budget=budget, max_tokens=24, native_step=native))
            prepared = engine.prepare([{"role": "user", "content": question}], tools, "required")
            run = engine.new_run(prepared, tmp_path / f"shared-{k}.jsonl")
            runs.append(run)
            gens.append(_drive(run, prepared))  # generators: nothing runs until stepped, so both
                                                # requests are bound before either begins
        results: list = [None, None]
        for _ in zip_longest(*[_steps(g, results, k) for k, g in enumerate(gens)]):
            pass
    finally:
        for run in runs:
            run.close()
    together = [_summary(results[k], tmp_path / f"shared-{k}.jsonl") for k in range(2)]
    assert together == alone


def _steps(gen, results: list, k: int):
    """Step ``gen`` one decode at a time; its result lands in ``results[k]``."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            results[k] = stop.value
            return
        yield


def _prefill_evictions(model, name: str, k: int, tmp_path) -> dict:
    question = QUESTIONS[k]
    engine = Engine(model, make_method(name, model), EngineConfig(budget=0.3, max_tokens=1))
    prepared = engine.prepare([{"role": "user", "content": question}], TOOLS, "required")
    trace = tmp_path / f"{name}-{k}.jsonl"
    engine.execute(prepared, trace)
    return {k: v for k, v in evictions(trace).items() if k[0] < 0}  # step -1: while the prompt was read


def test_query_agnostic_flag_matches_what_the_prompt_keeps(model, tmp_path):
    """Two questions with the same tokens' classes (and so the same token count): a query-agnostic
    method evicts the same prompt positions in every layer while it reads the prompt; a query-aware
    one (attention from the question, or its words) evicts other positions somewhere."""
    full = Engine(model, make_method("full", model))
    tagged = [full.prepare([{"role": "user", "content": q}], TOOLS, "required").plan.prompt for q in QUESTIONS]
    assert tagged[0].classes == tagged[1].classes and tagged[0].tokens != tagged[1].tokens
    for entry in registry.ENTRIES:
        a, b = (_prefill_evictions(model, entry.name, k, tmp_path) for k in range(2))
        if entry.prefill_mode != PrefillMode.NONE:
            assert a, f"{entry.name}: no eviction while reading the prompt: the check would be empty"
        if entry.query_aware:
            assert a != b, f"{entry.name} is registered query-aware but kept the same prompt positions"
        else:
            assert a == b, f"{entry.name} is registered query-agnostic but the question changed what it kept"
