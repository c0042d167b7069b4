"""The BFCL scoring path (real bfcl-eval data, real AST checker): correct answers pass, corrupted fail."""

from __future__ import annotations

import copy
import json
import sys

import pytest

from pask_local.eval.checker import decode_output, score_decoded, score_output
from pask_local.eval.data import CATEGORIES, Case, load_bundled
from pask_local.eval.reference import reference_calls, unsatisfiable


@pytest.fixture(scope="module", params=CATEGORIES)
def category_cases(request) -> list[Case]:
    cases = load_bundled(request.param)
    assert cases, request.param
    return cases


def _satisfiable(cases: list[Case]) -> list[Case]:
    return [c for c in cases if unsatisfiable(c.functions, c.answer) is None]


def test_reference_answer_is_valid_for_every_case(category_cases):
    usable = _satisfiable(category_cases)
    # only a handful of BFCL answers cannot be met by any output (dataset quirks)
    assert len(category_cases) - len(usable) <= max(1, len(category_cases) // 100)
    failures = []
    for case in usable:
        score = score_output(case, json.dumps(reference_calls(case.functions, case.answer)))
        if not score.valid:
            failures.append((case.id, score.error_type, score.errors))
    assert not failures, failures[:3]


def test_unsatisfiable_answers_really_fail(category_cases):
    for case in category_cases:
        if unsatisfiable(case.functions, case.answer) is not None:
            assert not score_output(case, json.dumps(reference_calls(case.functions, case.answer))).valid


def _corrupt_value(value, options):
    if isinstance(value, bool):
        candidates = [not value]
    elif isinstance(value, int):
        candidates = [value + 7919, value - 104729]
    elif isinstance(value, float):
        candidates = [value + 7919.5]
    elif isinstance(value, str):
        candidates = ["zq corrupted value xv"]
    elif isinstance(value, list):
        candidates = [[*value, "zq extra item"], []]
    elif isinstance(value, dict):
        candidates = [{"zq_corrupted_key": 1}]
    else:
        return None
    for cand in candidates:
        if cand not in options and cand != value:
            return cand
    return None


def _value_corruption(case: Case):
    """The reference with one argument value replaced by one outside its allowed values (or None)."""
    calls = reference_calls(case.functions, case.answer)
    answers = {name: params for entry in case.answer for name, params in entry.items()}
    for i, call in enumerate(calls):
        for param, value in call["arguments"].items():
            bad = _corrupt_value(value, answers[call["name"]][param])
            if bad is not None:
                out = copy.deepcopy(calls)
                out[i]["arguments"][param] = bad
                return out
    return None


def test_corrupted_answers_are_invalid(category_cases):
    n_value = 0
    for case in _satisfiable(category_cases):
        calls = reference_calls(case.functions, case.answer)
        wrong_name = copy.deepcopy(calls)
        wrong_name[0]["name"] += "_zq"
        assert not score_output(case, json.dumps(wrong_name)).valid, case.id

        if len(calls) > 1:
            assert score_output(case, json.dumps(calls[1:])).error_type.endswith("wrong_count"), case.id
        else:
            assert not score_output(case, json.dumps(calls + calls)).valid, case.id

        bad_value = _value_corruption(case)
        if bad_value is not None:
            n_value += 1
            assert not score_output(case, json.dumps(bad_value)).valid, (case.id, bad_value)

        required = [p for f in case.functions if f["name"] == calls[0]["name"]
                    for p in f["parameters"].get("required", [])]
        if required and required[0] in calls[0]["arguments"]:
            missing = copy.deepcopy(calls)
            del missing[0]["arguments"][required[0]]
            assert not score_output(case, json.dumps(missing)).valid, case.id
    assert n_value >= len(category_cases) // 2  # the value corruption applied to most cases


def test_unparseable_output_is_invalid_not_skipped():
    case = load_bundled("simple_python")[0]
    good = json.dumps(reference_calls(case.functions, case.answer))
    for text in ("", "calculate_triangle_area(base=10, height=5)", good[:-2], "[1, 2]", '{"name": 3, "arguments": {}}', '{"a": 1, "b": 2}'):
        score = score_output(case, text)
        assert not score.valid
        assert score.error_type.startswith("ast_decoder:"), (text, score)


def test_decode_output_formats():
    want = [{"f": {"a": 1}}]
    assert decode_output('{"name": "f", "arguments": {"a": 1}}') == want
    assert decode_output('[{"name": "f", "arguments": {"a": 1}}]') == want
    assert decode_output('{"name": "f", "arguments": "{\\"a\\": 1}"}') == want
    assert decode_output('[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]') == [
        {"f": {"a": 1}}, {"g": {}}]


def test_dotted_function_names_are_kept():
    # model_config is stubbed: names keep their dots (no vendor's underscore_to_dot conversion)
    case = next(c for c in load_bundled("simple_python") if "." in c.functions[0]["name"])
    assert score_output(case, json.dumps(reference_calls(case.functions, case.answer))).valid
    decoded = [{k.replace(".", "_"): v} for d in decode_output(json.dumps(
        reference_calls(case.functions, case.answer))) for k, v in d.items()]
    assert not score_decoded(case, decoded).valid


def test_model_config_module_is_the_stub():
    handler = "bfcl_eval.model_handler.api_inference.openai_completion"
    loaded_before = handler in sys.modules  # tests/test_bfcl_client.py imports BFCL's handler on purpose
    score_output(load_bundled("simple_python")[0], "[]")
    mod = sys.modules["bfcl_eval.constants.model_config"]
    assert "stand-in" in (mod.__doc__ or "")
    assert loaded_before or handler not in sys.modules  # scoring did not pull in the vendor handlers
