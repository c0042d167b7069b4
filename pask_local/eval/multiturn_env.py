"""BFCL multi-turn, bfcl-eval's side: conversations, executable environments, and scoring.

Everything here calls the installed ``bfcl-eval`` package as it is (nothing copied):
``bfcl_eval.utils.load_dataset_entry`` / ``load_ground_truth_entry`` read the conversations and
their ground truth (the function docs of the involved classes are filled in there, miss_func's
held-out functions moved to ``missed_function``); ``multi_turn_utils.execute_multi_turn_func_call``
runs calls on the case's environment instances (``initial_config``, ``involved_classes``; the
long_context categories load the long scenario); ``multi_turn_checker`` scores a conversation
(state of every instance and execution results against the ground truth, turn by turn, stopping
at the first failing turn) and its sub-checkers score single turns.

Classes: the four categories use GorillaFileSystem, MathAPI, MessageAPI, TwitterAPI, TicketAPI,
TradingBot, TravelAPI and VehicleControlAPI, all offline and deterministic (their random
generators are seeded per instance). WebSearchAPI (network) and the MemoryAPI_* classes
(memory_vector needs an embedding model) belong to other BFCL categories and are refused here.

``execute_multi_turn_func_call`` keeps its instances in its own module's globals, named after the
"model name" and the case id; every ``Environment`` uses a fresh random name prefix and
``release`` deletes what was created under it, so conversations never share state or leak memory.
"""

from __future__ import annotations

import copy
import json
import keyword
import secrets
from dataclasses import dataclass, field
from typing import Any

from ..errors import PaskError

MULTI_TURN_CATEGORIES: tuple[str, ...] = (
    "multi_turn_base", "multi_turn_long_context", "multi_turn_miss_param", "multi_turn_miss_func")
# classes that need a network or an embedding model (other BFCL categories): never instantiated here
EXCLUDED_CLASSES: tuple[str, ...] = ("WebSearchAPI", "MemoryAPI_kv", "MemoryAPI_vector", "MemoryAPI_rec_sum")


class MultiTurnError(PaskError):
    """A multi-turn category, case or call is missing or malformed."""


@dataclass(frozen=True)
class Conversation:
    """One BFCL multi-turn entry with its ground truth (``entry`` is BFCL's dict, as its checker wants it)."""

    id: str
    category: str
    turns: list[list[dict[str, Any]]]            # user messages per turn ([] on a held-out-function turn)
    functions: list[dict[str, Any]]              # BFCL function docs offered from the first turn
    held_out: dict[int, list[dict[str, Any]]]    # turn -> function docs added at that turn (miss_func)
    ground_truth: list[list[str]]                # per turn: the call strings BFCL expects
    entry: dict[str, Any] = field(compare=False, repr=False)

    @property
    def long_context(self) -> bool:
        # as BFCL's runner and checker decide it (from the category in the id)
        return "long_context" in self.category or "composite" in self.category


def _bfcl() -> Any:
    try:
        import bfcl_eval.utils as utils
    except ImportError:
        raise MultiTurnError("the bfcl-eval package is not installed (pip install --no-deps bfcl-eval)") from None
    return utils


def check_categories(names: list[str]) -> list[str]:
    """Validate category names (one-line error for unknown ones); duplicates removed, order kept."""
    for name in names:
        if name not in MULTI_TURN_CATEGORIES:
            raise MultiTurnError(f"unknown multi-turn category {name!r}; choose from {', '.join(MULTI_TURN_CATEGORIES)}")
    return list(dict.fromkeys(names))


def load_conversations(category: str) -> list[Conversation]:
    """All conversations of one BFCL multi-turn category, in BFCL's order."""
    check_categories([category])
    utils = _bfcl()
    entries = utils.load_dataset_entry(category)
    answers = {str(a["id"]): a["ground_truth"] for a in utils.load_ground_truth_entry(category)}
    out = []
    for e in entries:
        cid = str(e["id"])
        bad = [c for c in e["involved_classes"] if c in EXCLUDED_CLASSES]
        if bad:
            raise MultiTurnError(f"{cid} needs {', '.join(bad)} (network or embedding model), which is not supported")
        if cid not in answers:
            raise MultiTurnError(f"bfcl-eval data: no ground truth for {cid}")
        gt = answers[cid]
        if len(gt) != len(e["question"]):
            raise MultiTurnError(f"bfcl-eval data: {cid} has {len(e['question'])} turns but {len(gt)} ground-truth turns")
        held = {int(k): list(v) for k, v in e.get("missed_function", {}).items()}
        out.append(Conversation(cid, category, e["question"], list(e["function"]), held, gt, e))
    return out


def call_string(name: str, arguments: Any) -> str:
    """A call as the Python expression BFCL's executor evaluates: ``name(key=value, ...)``.

    The name and every key must be plain identifiers and the values are ``repr``s of JSON values,
    so the string ``eval`` sees is one call with literal arguments (nothing else can be smuggled in).
    """
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise MultiTurnError(f"function name {str(name)[:60]!r} is not an identifier")
    if not isinstance(arguments, dict):
        raise MultiTurnError(f"arguments of '{name}' must be a JSON object")
    parts = []
    for key, value in arguments.items():
        if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
            raise MultiTurnError(f"argument name {str(key)[:60]!r} of '{name}' is not an identifier")
        parts.append(f"{key}={value!r}")
    return f"{name}({', '.join(parts)})"


def new_run_name() -> str:
    """A model-name prefix of letters, digits and '_' only (BFCL rewrites '-./:' in instance names)."""
    return "pask_mt_" + secrets.token_hex(6)


def _utils_module() -> Any:
    _bfcl()
    import bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils as mtu

    return mtu


class Environment:
    """A conversation's live environment instances, driven through BFCL's own executor."""

    def __init__(self, conv: Conversation, name: str) -> None:
        self.conv = conv
        self.name = name
        self.instances: dict[str, Any] = {}
        self.execute([])  # instantiate and load the scenario now, as BFCL's runner does before turn 0

    def execute(self, calls: list[str]) -> list[str]:
        """Run call strings in order; a call that raises yields BFCL's "Error during execution: ..." text."""
        mtu = _utils_module()
        results, self.instances = mtu.execute_multi_turn_func_call(
            calls, self.conv.entry.get("initial_config", {}), self.conv.entry["involved_classes"], self.name,
            self.conv.id, long_context=self.conv.long_context, is_evaL_run=False)
        return list(results)

    def fork(self, name: str) -> Environment:
        """A deep copy of the current state, under its own name (the per-turn score runs the ground truth there)."""
        mtu = _utils_module()
        other = Environment(self.conv, name)
        names = vars(mtu)
        for cls, inst in other.instances.items():
            # BFCL finds instances by their global name: put the copy under the name it just registered
            key = next(k for k, v in names.items() if v is inst)
            names[key] = other.instances[cls] = copy.deepcopy(self.instances[cls])
        return other


def release(prefix: str) -> None:
    """Forget every instance BFCL's executor created under names starting with ``prefix``."""
    mtu = _utils_module()
    for key in [k for k in vars(mtu) if k.startswith(prefix)]:
        del vars(mtu)[key]


def score_conversation(conv: Conversation, decoded: list[list[list[str]]], name: str) -> dict[str, Any]:
    """BFCL's verdict on a conversation: ``{"valid": bool, ...}`` from ``multi_turn_checker``.

    ``decoded``: per turn, per step, the call strings executed (steps without calls left out, as
    BFCL's evaluator drops them). A conversation cut short (the step limit, an error) is invalid,
    as BFCL's evaluator rules a force-terminated one.
    """
    _bfcl()
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    if len(decoded) != len(conv.ground_truth):
        return {"valid": False, "error_type": "multi_turn:force_terminated",
                "error_message": f"{len(decoded)} of {len(conv.ground_truth)} turns were run"}
    try:
        return multi_turn_checker(decoded, conv.ground_truth, conv.entry, conv.category, name + "_score")
    finally:
        release(name + "_score")


def score_turn(turn: int, conv: Conversation, live: Environment, expected: Environment | None,
               expected_results: list[str], steps: list[list[str]], results_so_far: list[str]) -> bool:
    """Turn-level verdict with BFCL's sub-checkers, judged from where the model stood.

    A turn with ground truth: ``expected`` is the model's environment as it was before the turn
    with the ground-truth calls of this turn run on it; the turn is correct when the model made a
    call, every instance's state after its turn equals ``expected`` (``state_checker``) and its
    execution results so far contain the ground truth's of this turn (``response_checker``), the
    two checks ``multi_turn_checker`` makes per turn. A turn whose ground truth is empty
    (miss_param, miss_func: the model should ask) is correct when the model made no call
    (``multi_turn_irrelevance_checker``).
    """
    _bfcl()
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
        multi_turn_irrelevance_checker,
        response_checker,
        state_checker,
    )
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import is_empty_execute_response

    truth = conv.ground_truth[turn]
    if not truth:
        return bool(multi_turn_irrelevance_checker([steps], [truth])["valid"])
    if expected is None or not steps or is_empty_execute_response(steps):
        return False
    if not state_checker(live.instances, expected.instances)["valid"]:
        return False
    return bool(response_checker(results_so_far, expected_results, turn)["valid"])


def function_names(functions: list[dict[str, Any]]) -> list[str]:
    return [str(f.get("name")) for f in functions]


def dumps_result(value: Any) -> str:
    """A tool result as message text (BFCL's executor already returns strings; anything else as JSON)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
