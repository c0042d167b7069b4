"""Calibration cases on an instruct model are measured on the prompt the eval decodes: the model's
own tool protocol (Qwen2.5-Coder 0.5B's ``<tools>`` block and ``<tool_call>`` blocks), not the
instruction prompt. The teacher-forced continuation is the call the engine's native grammar emits."""

from __future__ import annotations

import pytest
from pask_local.calibration.cases import CaseSkipped, build_case
from pask_local.calibration.cli import calib_cases

from pask_local.classes import StructuralClass as C
from pask_local.eval.prompting import make_task, task_plan
from pask_local.llm import Model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen(qwen05_model) -> Model:
    return qwen05_model


def test_native_case_is_the_eval_prompt_and_the_native_call(qwen) -> None:
    built = 0
    for case in calib_cases(["simple_python", "parallel"])[:6]:
        try:
            tc = build_case(qwen, case, style="auto")
        except CaseSkipped:
            continue
        built += 1
        plan = task_plan(qwen, make_task(case, True), "auto", None, None)
        assert plan.fmt is not None  # this model's template has a tool protocol
        assert tc.tokens[:tc.n_prompt] == list(plan.prompt.tokens)  # exactly what eval decodes
        assert tc.classes[:tc.n_prompt] == list(plan.prompt.classes)
        assert tc.gold.startswith("<tool_call>") and tc.gold.rstrip().endswith("</tool_call>")
        cont = tc.tokens[tc.n_prompt:]
        opener = qwen.tokenize("<tool_call>", add_special=False, parse_special=True)
        assert cont[:len(opener)] == opener  # one special token, not the text spelled out
        gen = set(tc.classes[tc.n_prompt:])
        assert {C.GEN_NAME, C.GEN_KEY} <= gen and all(c.is_generated for c in gen)
        plain = build_case(qwen, case, style="plain")  # the instruction prompt is another prompt
        assert plain.tokens[:plain.n_prompt] != tc.tokens[:tc.n_prompt] and not plain.gold.startswith("<")
    assert built >= 3


def test_parallel_native_cases_are_built(qwen) -> None:
    """A parallel case's gold calls are several <tool_call> blocks; the grammar can end after them
    (it could take more blocks), so the case is built, not skipped."""
    built = 0
    for case in calib_cases(["parallel", "parallel_multiple"])[:4]:
        tc = build_case(qwen, case, style="auto")
        assert tc.gold.count("<tool_call>") >= 2 and tc.gold.count("<tool_call>") == tc.gold.count("</tool_call>")
        built += 1
    assert built == 4
