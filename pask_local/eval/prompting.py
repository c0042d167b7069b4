"""What the harness hands the prompt renderer for one case: request text, few-shot examples, call shape.

The prompt itself is planned by ``pask_local.chat.protocol.plan``, as in the KV engine, so every method
sees identical prompts: ``--prompt-style native`` is the model's own tool-call protocol (the GGUF's
chat template with its ``tools``; ``<tool_call>`` output, turned into the call JSON the checker
reads by ``checker_text``), ``plain`` the instruction prompt (plain format for base models such as
the default Gemma 3 270M, inside the chat template for chat models; the only style with few-shot
examples), ``auto`` native when the template has it. This module decides:

- the few-shot examples: a fixed rule over the *calibration* split (``pick_examples``), never an
  evaluation case and not tuned on results; shown as (request, call JSON) pairs;
- the call shape: a JSON list of calls for the parallel categories, one call object otherwise
  (``is_parallel``);
- the request text: the user's message, preceded by the case's system message when it has one;
- a conversation (a dataset turn with earlier ``tool_calls`` and ``tool`` results) is handed to the
  prompt whole, as the message list ``run --messages`` would render (``Task.messages``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..chat.protocol import Plan, plan
from ..errors import PaskError
from ..llm import Model
from ..messages import Message, ToolChoice, user_message
from ..schema.tools import as_tools
from .data import Case, load_bundled
from .reference import reference_calls, unsatisfiable
from .split import split_of

# Example categories and the size cap (characters of function JSON) of the fixed selection rule.
EXAMPLE_CATEGORIES: tuple[str, ...] = ("simple_python", "multiple", "parallel")
EXAMPLE_MAX_FUNCTION_CHARS = 1200


@dataclass(frozen=True)
class Task:
    """The inputs of one generation: BFCL functions, request, examples, and call shape.

    ``messages``: the whole conversation when the case has one (None: ``request`` is the one user turn).
    """

    functions: list[dict[str, Any]]
    request: str
    examples: list[tuple[str, str]]
    parallel: bool
    messages: tuple[Message, ...] | None = None

    def conversation(self) -> list[Message]:
        """The messages the prompt renders."""
        return list(self.messages) if self.messages is not None else user_message(self.request)


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
    messages = None
    if case.is_conversation:
        messages = tuple(case.conversation())
        if case.tools is not None:
            # a catalog is a shared prefix: the case's system text joins its own turn, as request_text does
            messages = fold_system(messages)
    return Task(case.prompt_functions, request_text(case), examples, parallel, messages)


def fold_system(messages: tuple[Message, ...]) -> tuple[Message, ...]:
    """System messages moved into the first user message (``system\n\nuser``), so the prompt's
    system + tools prefix is the template's own and equal for every case."""
    system = "\n".join(m.content or "" for m in messages if m.role == "system")
    rest = [m for m in messages if m.role != "system"]
    if not system:
        return tuple(rest)
    for i, m in enumerate(rest):
        if m.role == "user":
            rest[i] = Message("user", f"{system}\n\n{m.content or ''}")
            break
    return tuple(rest)


# --prompt-style -> the engine's prompt style (chat.protocol.STYLES)
ENGINE_STYLES = {"auto": "auto", "native": "native", "plain": "instruction"}
PROMPT_STYLES = tuple(ENGINE_STYLES)


def check_prompt_style(style: str) -> str:
    if style not in ENGINE_STYLES:
        raise PaskError(f"unknown prompt style {style!r} (choose from {', '.join(PROMPT_STYLES)})")
    return style


def task_plan(model: Model, task: Task, style: str, max_string: int | None, max_calls: int | None) -> Plan:
    """The protocol plan of one case: a call is required (BFCL asks for calls)."""
    return plan(model, as_tools(task.functions), task.conversation(), ToolChoice("required"),
                parallel=task.parallel, style=ENGINE_STYLES[style], examples=task.examples,
                max_string=max_string, max_calls=max_calls)


def checker_text(p: Plan, raw: str, finish: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """(the text the checker reads, extra record fields): native output becomes the call JSON
    (one object, or the list with parallel calls); the raw output is kept in the record."""
    if p.fmt is None:
        return raw, {}
    parsed = p.parse(raw, finish, max_tokens).parsed
    return (json.dumps(parsed, ensure_ascii=False) if parsed is not None else raw), {"raw_output": raw}


def render_tokens(model: Model, task: Task, style: str) -> list[int]:
    """The prompt tokens ``task_plan`` would give, without building the grammar (cheap enough to
    measure every case before a run, and every candidate catalog)."""
    from ..chat.protocol import resolve_style
    from ..tagging.native import render_native
    from ..tagging.prompt import bos_text, map_spans, render_prompt

    rendering, fmt = resolve_style(model, ENGINE_STYLES[style])
    tools = as_tools(task.functions) if task.functions else []  # none: the bare template (catalog counts)
    messages = task.conversation()
    if fmt is None:
        request: str | list[Message] = messages
        if len(messages) == 1 and messages[0].role == "user":
            # the instruction prompt refuses an empty request: a catalog count measures with a stand-in
            request = messages[0].content or "?"
        return render_prompt(model, tools, request, examples=task.examples, parallel=task.parallel,
                             style=rendering).tokens
    template = model.chat_template()
    assert template is not None
    spans = render_native(template, tools, messages, bos_text=bos_text(model), strip_bos=model.add_bos)
    return map_spans(model, spans, special_template=True)[0]


def prefix_counter(model: Model, style: str, use_examples: bool = True) -> Callable[[list[dict[str, Any]]], int]:
    """``count(functions)``: tokens of the prompt that shows ``functions`` with an empty user turn:
    the system + tools prefix every case of a catalog group shares (plus the few tokens of the turn)."""
    examples = example_pairs(pick_examples(), False) if use_examples else []

    def count(functions: list[dict[str, Any]]) -> int:
        return len(render_tokens(model, Task(functions, "", examples, False), style))

    return count
