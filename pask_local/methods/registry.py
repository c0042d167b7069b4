"""Every KV-persistence method and PASK variant, registered once.

Each ``MethodEntry`` says what the method is (one help line, how it reads the prompt, whether it
is query-aware and why, whether it takes a policy file) and builds it. A PASK variant is PASK with
a ``PaskVariant``: another within-class order or residual rule and where its default policy comes
from. The CLI (``run``, ``serve``, ``eval``, ``methods``), the eval harness, the server's request
validation and ``engine.factory.make_method`` all read this table; no other module lists names.

Query-aware: which prompt positions persist depends on the question's text (its words or the
attention its tokens pay). Query-agnostic: decided from the prompt's structure and positions alone,
so two questions of equal token count and classes keep the same prompt positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import PaskError
from .base import Method, PrefillMode
from .full import FullKV
from .h2o import H2O
from .pask import ATTENTION, NEWEST_FIRST, PASK, RECONSTRUCTION, TOOL_RELEVANCE, Order
from .pyramidkv import PyramidKV
from .scored import KeyDiff, KNorm, KVzipStyle, SnapKVPrefix
from .snapkv import SnapKV
from .streaming import StreamingLLM
from .tova import TOVA

if TYPE_CHECKING:
    from ..llm import Model
    from ..policy import Policy

Warn = Callable[[str], None]


@dataclass(frozen=True)
class PaskVariant:
    """PASK with another within-class order / residual rule (None: the policy's own) and where its
    policy comes from when none is given: ``model`` (the model's shipped calibrated policy, else the
    hand-written prior), ``prior`` (always the hand-written prior) or ``hybrid`` (``hybrid_policy``)."""

    order: Order | None = None
    residual: str | None = None
    policy: str = "model"


@dataclass(frozen=True)
class MethodEntry:
    name: str
    help: str                            # one line, for `--help` and `pask-local methods`
    prefill_mode: PrefillMode            # as built with its default policy (test_method_registry checks)
    query_aware: bool
    why: str                             # why it is query-aware or query-agnostic
    method_class: type[Method] | None = None  # a baseline: its class, built with its defaults
    variant: PaskVariant | None = None        # a PASK variant
    takes_policy: bool = False           # accepts a policy file (--policy)

    @property
    def default_policy(self) -> bool:
        """Runs the model's default (resolved) policy when none is given."""
        return self.variant is not None and self.variant.policy == "model"

    @property
    def scored(self) -> bool:
        """Runs a scoring pass over the prompt before its prefill (``Method.prompt_scorer``)."""
        return bool(self.method_class is not None and self.method_class.prompt_scorer)

    @property
    def policy_label(self) -> str:
        """What `pask-local methods` shows in its policy column."""
        if self.variant is None:
            return "-"
        source = {"model": "model default", "prior": "hand-written prior", "hybrid": "hybrid floors",
                  "floors": "floors only"}
        return source[self.variant.policy] + (", --policy" if self.takes_policy else "")

    def build(self, model: Model, policy: str | Path | Policy | None = None, warn: Warn | None = None) -> Method:
        """This method on ``model``; ``policy`` (a Policy or a policy file) where it takes one."""
        if self.variant is None:
            if policy is not None:
                raise PaskError(f"--policy applies to {_and(POLICY_METHODS)} only, not '{self.name}'")
            assert self.method_class is not None
            return self.method_class()
        return self._build_pask(self.variant, model, policy, warn)

    def _build_pask(self, v: PaskVariant, model: Model, policy: str | Path | Policy | None,
                    warn: Warn | None) -> PASK:
        from ..model_info import swa_layers
        from ..policy import Policy
        from ..policy.handwritten import floors_policy, handwritten_policy, hybrid_policy
        from ..policy.shipped import resolve_default_policy

        if policy is not None and not self.takes_policy:
            raise PaskError(f"{self.name} runs the hand-written prior policy; use --method pask with --policy")
        if policy is None and v.policy == "prior":
            pol = handwritten_policy(model.n_layer)
        elif policy is None and v.policy == "hybrid":
            pol = hybrid_policy(model.n_layer)
        elif policy is None and v.policy == "floors":
            pol = floors_policy(model.n_layer)
        elif policy is None:
            pol, warning = resolve_default_policy(model)
            if warning and warn is not None:
                warn(warning)
        elif isinstance(policy, Policy):
            pol = policy
        else:
            pol = Policy.load(policy)
        pol.check_model(model.n_layer)
        changes: dict[str, str] = {}
        if v.order is not None:
            changes["within_class_order"] = v.order.name
        if v.residual is not None:
            changes["residual"] = v.residual
        if changes:  # a copy: the caller's policy (and the server's shared default) stays as it was
            pol = dataclasses.replace(pol, **changes)
        swa, window = swa_layers(model)
        return PASK(pol, swa_layers=swa, window=window, name=self.name)


_AGNOSTIC_PASK = ("class quotas, span-head order and the held tail come from the prompt's structural classes "
                  "and positions, not its words")
ENTRIES: tuple[MethodEntry, ...] = (
    MethodEntry("full", "Full KV: every position stays (the reference)", PrefillMode.NONE, False,
                "keeps every position", FullKV),
    MethodEntry("streaming", "StreamingLLM: the first 4 tokens and the newest window", PrefillMode.EVICT_WHILE_READING,
                False, "keeps positions by place alone (sinks and the newest)", StreamingLLM),
    MethodEntry("h2o", "H2O: heavy hitters by accumulated attention, half the room for the newest",
                PrefillMode.EVICT_WHILE_READING, True,
                "ranks by the attention every query so far paid, the question's tokens included", H2O),
    MethodEntry("snapkv", "SnapKV: the prompt scored by its last 32 tokens' attention, compressed once",
                PrefillMode.WHOLE_THEN_COMPRESS, True,
                "the observation window (the prompt's last tokens: the question) scores the prompt", SnapKV),
    MethodEntry("pyramidkv", "PyramidKV: SnapKV's selection with layer budgets decreasing with depth",
                PrefillMode.WHOLE_THEN_COMPRESS, True, "SnapKV's question-window scores", PyramidKV),
    MethodEntry("tova", "TOVA: the tokens the newest query attends to most", PrefillMode.EVICT_WHILE_READING,
                True, "ranks by the newest query's attention (while prefilling: the question's tokens)", TOVA),
    MethodEntry("pask", "PASK with the model's calibrated policy (else the prior), evicting while it prefills",
                PrefillMode.PLANNED,
                False, _AGNOSTIC_PASK + " (with its shipped policies; a policy file ordering by attention or "
                "tool-relevance makes it query-aware: method.order.query_aware)",
                variant=PaskVariant(), takes_policy=True),
    MethodEntry("pask-prior", "PASK with the hand-written prior policy", PrefillMode.PLANNED, False,
                _AGNOSTIC_PASK, variant=PaskVariant(policy="prior")),
    MethodEntry("pask-attn", "PASK's class shares, ranked by attention inside each class",
                PrefillMode.WHOLE_THEN_COMPRESS, True,
                "inside a class, the question window's attention decides", variant=PaskVariant(order=ATTENTION),
                takes_policy=True),
    MethodEntry("pask-hybrid", "structural floors; the rest of the budget by attention",
                PrefillMode.WHOLE_THEN_COMPRESS, True,
                "beyond the floors, the question window's attention decides",
                variant=PaskVariant(order=ATTENTION, residual="attention", policy="hybrid"), takes_policy=True),
    MethodEntry("floors-only", "structural floors kept whole; the rest of the budget to the newest tokens",
                PrefillMode.PLANNED, False, "floors by class, the rest by position: no words, no attention",
                variant=PaskVariant(order=NEWEST_FIRST, residual="recent", policy="floors")),
    MethodEntry("snapkv-prefix", "SnapKV scored by the prefix's own tail (the 32 tokens before the user's turn)",
                PrefillMode.PLANNED, False, "its observation window ends before the question (a scoring pass "
                "reads only the part before the user's turn)", SnapKVPrefix),
    MethodEntry("kvzip", "KVzip-style: entries scored by the attention a re-presentation of the prefix pays them",
                PrefillMode.PLANNED, False, "scores how much rebuilding the prefix itself needs each entry "
                "(a scoring pass reads only the part before the user's turn)", KVzipStyle),
    MethodEntry("pask-zip", "structural floors; the rest of the budget by kvzip's reconstruction score",
                PrefillMode.PLANNED, False, "floors by class; beyond them, kvzip's scoring pass ranks (it reads "
                "only the part before the user's turn)",
                variant=PaskVariant(order=RECONSTRUCTION, residual="reconstruction", policy="hybrid")),
    MethodEntry("knorm", "KNorm: the keys of lowest norm persist (no attention, no scores from queries)",
                PrefillMode.PLANNED, False, "reads only the prefix's own keys (a pass over the part before "
                "the user's turn)", KNorm),
    MethodEntry("keydiff", "KeyDiff: the keys least like their head's mean key direction persist (no attention)",
                PrefillMode.PLANNED, False, "reads only the prefix's own keys (a pass over the part before "
                "the user's turn)", KeyDiff),
    MethodEntry("pask-tools", "PASK's class shares; the tools the query's words name persist first",
                PrefillMode.PLANNED, True, "reads the question's words (tagging.relevance) to order the tools",
                variant=PaskVariant(order=TOOL_RELEVANCE), takes_policy=True),
)
REGISTRY: dict[str, MethodEntry] = {e.name: e for e in ENTRIES}
if len(REGISTRY) != len(ENTRIES):
    raise RuntimeError("a method name is registered twice")

for _e in ENTRIES:  # a baseline class's name is its entry's (defined here, not in its module)
    if _e.method_class is not None:
        _e.method_class.name = _e.name

METHOD_NAMES: tuple[str, ...] = tuple(REGISTRY)
# baselines in study order (eval.study ranks rows by it)
BASELINES: dict[str, type[Method]] = {e.name: e.method_class for e in ENTRIES if e.method_class is not None}
PASK_VARIANTS: tuple[str, ...] = tuple(e.name for e in ENTRIES if e.variant is not None)
POLICY_METHODS: tuple[str, ...] = tuple(e.name for e in ENTRIES if e.takes_policy)
DEFAULT_POLICY_METHODS: tuple[str, ...] = tuple(e.name for e in ENTRIES if e.default_policy)
QUERY_AGNOSTIC: tuple[str, ...] = tuple(e.name for e in ENTRIES if not e.query_aware)

# what `pask-local run` and `serve` run when no --method is given: of the methods that evict while they
# read (so a batched slot holds a prompt longer than its budget), the most accurate in the 153-case
# method study (docs/results.md: pask-prior 51.3 / 39.1 % at 0.33 / 0.2; streaming 49.7 / 38.7, the
# calibrated pask 46.9 / 33.5). pask-hybrid scores higher but prefills the whole prompt first.
DEFAULT_METHOD = "pask-prior"
# what `pask-local compress` runs when no --method is given: the query-agnostic PASK variant chosen on
# the calibration split of the 8k catalog workload (docs/results.md "Compress once": floors-only 9,
# pask-zip 8, pask-prior 6 correct of 20 over 0.33 and 0.2, by a rule fixed before the runs)
DEFAULT_PREFIX_METHOD = "floors-only"
# what runs a policy file given without --method
POLICY_FILE_METHOD = "pask"
assert DEFAULT_METHOD in REGISTRY and POLICY_FILE_METHOD in POLICY_METHODS
assert DEFAULT_PREFIX_METHOD in QUERY_AGNOSTIC
PASK.name = POLICY_FILE_METHOD  # a PASK built directly (tests, calibration) reports as plain pask


def get(name: str) -> MethodEntry:
    """The entry of ``name`` (a PaskError naming the choices for an unknown one)."""
    entry = REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise PaskError(f"unknown method '{name}' (choose from {', '.join(METHOD_NAMES)})")
    return entry


def make(name: str, model: Model, policy: str | Path | Policy | None = None, warn: Warn | None = None) -> Method:
    """Build the registered method ``name`` on ``model`` (see ``MethodEntry.build``)."""
    return get(name).build(model, policy, warn)


def choices_help() -> str:
    """Every method with its help line, for an option's help text."""
    return "; ".join(f"{e.name} ({e.help})" for e in ENTRIES)


def _and(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)
