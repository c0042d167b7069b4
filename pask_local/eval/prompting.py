"""What the harness hands the prompt renderer for one case: request text, few-shot examples, call shape.

The prompt itself is rendered and tagged by ``pask_local.tagging.prompt.render_prompt`` (plain format
for base models such as the default Gemma 3 270M, the GGUF's chat template for chat models), the same
renderer the KV engine uses, so every method sees identical prompts. This module decides:

- the few-shot examples: a fixed rule over the *calibration* split (``pick_examples``), never an
  evaluation case and not tuned on results; shown as (request, call JSON) pairs;
- the call shape: a JSON list of calls for the parallel categories, one call object otherwise
  (``is_parallel``);
- the request text: the user's message, preceded by the case's system message when it has one.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .data import Case, load_bundled
from .reference import reference_calls, unsatisfiable
from .split import split_of

# Example categories and the size cap (characters of function JSON) of the fixed selection rule.
EXAMPLE_CATEGORIES: tuple[str, ...] = ("simple_python", "multiple", "parallel")
EXAMPLE_MAX_FUNCTION_CHARS = 1200


@dataclass(frozen=True)
class Task:
    """The inputs of one generation: BFCL functions, request, examples, and call shape."""

    functions: list[dict[str, Any]]
    request: str
    examples: list[tuple[str, str]]
    parallel: bool


def is_parallel(case: Case) -> bool:
    return "parallel" in case.checker_category


def _order_key(case: Case) -> str:
    return hashlib.sha256(("pask-example-v1:" + case.id).encode()).hexdigest()


@functools.cache
def pick_examples(categories: tuple[str, ...] = EXAMPLE_CATEGORIES) -> tuple[Case, ...]:
    """Fixed few-shot rule: per example category, among calibration cases with a satisfiable answer,
    no system message and function JSON of at most ``EXAMPLE_MAX_FUNCTION_CHARS`` characters, the one
    whose ``sha256("pask-example-v1:" + id)`` is smallest."""
    chosen = []
    for cat in categories:
        pool = [
            c for c in load_bundled(cat)
            if split_of(c.id) == "calib" and c.system is None and c.answer is not None
            and unsatisfiable(c.functions, c.answer) is None
            and len(json.dumps(c.functions, ensure_ascii=False)) <= EXAMPLE_MAX_FUNCTION_CHARS
        ]
        if pool:
            chosen.append(min(pool, key=_order_key))
    return tuple(chosen)


def example_pairs(examples: tuple[Case, ...], parallel: bool) -> list[tuple[str, str]]:
    """(request, call JSON) pairs in the call shape of ``parallel``; multi-call examples only there."""
    pairs = []
    for ex in examples:
        assert ex.answer is not None
        calls = reference_calls(ex.functions, ex.answer)
        if parallel:
            pairs.append((ex.request, json.dumps(calls, ensure_ascii=False)))
        elif len(calls) == 1:
            pairs.append((ex.request, json.dumps(calls[0], ensure_ascii=False)))
    return pairs


def request_text(case: Case) -> str:
    return f"{case.system}\n\n{case.request}" if case.system else case.request


def make_task(case: Case, use_examples: bool = True) -> Task:
    parallel = is_parallel(case)
    examples = example_pairs(pick_examples(), parallel) if use_examples else []
    return Task(case.functions, request_text(case), examples, parallel)
