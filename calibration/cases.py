"""Turns a BFCL case into a teacher-forcing case: prompt + gold call tokens, one class per token.

The prompt is exactly what the engine and the eval harness decode for the case (``make_task`` then
the protocol plan of the eval's prompt style: ``plain``, the instruction prompt with few-shot
examples; ``native``, the model's own chat template with its tools block, e.g. Qwen2.5's
``<tools>``; ``auto``, native when the template has it). The gold continuation is the call our
grammar would emit for the case's reference answer (``eval.reference.reference_calls``): compact
JSON with ``", "`` / ``": "`` separators, required properties first then optional ones, each in
schema order, inside the native call blocks (``<tool_call>...</tool_call>``) for the native style,
tokenised with llama.cpp. Its tokens are accepted into the plan's call grammar and tagged by
``CallTagger``, as the engine tags generated tokens; a gold call the grammar rejects (a dataset
answer outside the schema) makes the case unusable (``CaseSkipped`` with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pask_local.classes import StructuralClass
from pask_local.errors import NativeError, PaskError, SchemaError
from pask_local.eval.data import Case
from pask_local.eval.gold import CaseSkipped, gold_call_text, order_like_schema, ordered_calls, plan_gold_text  # noqa: F401  (re-exported)
from pask_local.eval.prompting import make_task, task_plan
from pask_local.eval.reference import reference_calls, unsatisfiable
from pask_local.grammar.state import GrammarState
from pask_local.llm import Model
from pask_local.tagging.generated import CallTagger


@dataclass
class TFCase:
    """Token ids of prompt + gold continuation, one structural class per token."""

    tokens: list[int]
    classes: list[StructuralClass]
    n_prompt: int
    id: str = ""
    category: str = ""
    gold: str = ""

    @property
    def n_cont(self) -> int:
        return len(self.tokens) - self.n_prompt

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.classes):
            raise PaskError(f"case {self.id}: {len(self.tokens)} tokens but {len(self.classes)} classes")
        if not 0 < self.n_prompt < len(self.tokens):
            raise PaskError(f"case {self.id}: needs a non-empty prompt and continuation")


def tag_continuation(model: Model, plan: Any, text: str) -> tuple[list[int], list[StructuralClass]]:
    """Tokenise ``text`` and tag each token through the plan's call grammar (CaseSkipped if it rejects)."""
    tokens = model.tokenize(text, add_special=False, parse_special=plan.fmt is not None)
    state = GrammarState(model.vocab, plan.grammar.text)
    try:
        tagger = CallTagger(model, plan.grammar, state)
        classes = []
        for tok in tokens:
            try:
                classes.append(tagger.accept(tok, model.piece(tok)))
            except NativeError:
                raise CaseSkipped(f"the grammar rejects the gold call at token {len(classes)}") from None
        # can_end, not is_done: a parallel native grammar (block (sep block)*) may always take one
        # more block, so it never reaches a state where it cannot continue; generation ends it at EOG
        if not state.can_end():
            raise CaseSkipped("the gold call does not complete the grammar")
    finally:
        state.close()
    return tokens, classes


def build_case(model: Model, case: Case, use_examples: bool = True, max_tokens: int = 0,
               style: str = "plain") -> TFCase:
    """The teacher-forcing case for ``case`` under the eval's prompt ``style`` (plain | native | auto;
    CaseSkipped when it cannot be one)."""
    if case.answer is None:
        raise CaseSkipped("no possible answer")
    why = unsatisfiable(case.functions, case.answer)
    if why:
        raise CaseSkipped(f"unsatisfiable answer: {why}")
    task = make_task(case, use_examples)
    try:
        plan = task_plan(model, task, style, None, None)  # parses the tools: SchemaError if unsupported
    except SchemaError as exc:
        raise CaseSkipped(f"schema not supported: {exc}") from None
    text = plan_gold_text(plan, reference_calls(task.functions, case.answer), task.parallel)
    prompt = plan.prompt
    cont, cont_classes = tag_continuation(model, plan, text)
    if max_tokens and len(prompt.tokens) + len(cont) > max_tokens:
        raise CaseSkipped(f"{len(prompt.tokens) + len(cont)} tokens > max {max_tokens}")
    return TFCase(tokens=list(prompt.tokens) + cont, classes=list(prompt.classes) + cont_classes,
                  n_prompt=len(prompt.tokens), id=case.id, category=case.category, gold=text)
