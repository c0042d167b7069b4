"""PASK: keep, per layer group, each structural class's share given by a compiled policy.

The ``recent`` newest positions, every generated token (the call being written) and the prompt's
tail (``hold_tail``: of its last ``recent`` tokens, the final run of query and template tokens, i.e.
the question and the assistant's header, which SnapKV's observation window also holds) are kept
first, capacity permitting: decode-time evictions come from the rest of the prompt. Among the rest, within a group g, class c
keeps ``ceil(keep[g][c] * n_c)`` of its ``n_c`` tokens so far (classes in the policy's
``never_evict`` keep all); within a class the policy's ``within_class_order`` says which go first:
``oldest-first``, ``newest-first``, or ``span-head`` (a span is a run of same-class tokens, e.g. one
tool's description: every span loses its tail before any span loses its head, so each tool keeps
the start of its description instead of the oldest tools losing theirs whole), or ``attention``
(the tokens that the prompt's last ``window`` queries attend to most persist first: SnapKV's pooled
observation-window statistic, used only to rank tokens inside a class whose share the policy fixed),
or ``tool-relevance`` (span-head, but the entries of the tools whose words the query shares persist
first, ``tagging.relevance``: a tool's description, parameter names and types outlast every
less relevant tool's; decided from the prompt's text before prefill, so it evicts while prefilling).
If rounding leaves the layer over capacity, the least protective classes (``PROTECTION_ORDER``) give
up tokens first, in the same order; if it leaves room, the most protective evicted tokens come back.

A policy with ``residual`` ``attention`` (the ``pask-hybrid`` variant): only its floors are class quotas; the
capacity left after them goes to the tokens the observation window attends to most, whatever their
class (every class without a floor shares one protection rank, so attention alone orders them).
Structure says what must persist (names, the query, the call); attention ranks everything else.
With ``residual`` ``recent`` (the ``floors-only`` variant) the newest tokens fill the rest instead.
With ``residual`` ``reconstruction`` (the ``pask-zip`` variant) the order ``reconstruction`` fills it: the
entries a re-presentation of the part before the user's turn attends to most (the scoring pass of
``kvzip``, ``engine.prescore``; the order declares it, so the engine runs it and ``bind`` gets its
per-layer scores). It never reads the question: decided before prefill, and a prefix compresses once.
With the structural orders only this lookup runs online and the prompt is evicted while it is
prefilled; ``attention`` needs the statistic, so the prompt is prefilled whole and compressed once.
The within-class orders are small ``Order`` objects (``ORDERS``, by the policy's name for them); a
PASK variant (``methods.registry``) is PASK with another order or residual, never a switch in here.
``PASK.bind`` compiles the policy for one request into a frozen ``PASKPlan`` (class quotas, the held
tail, tool-relevance priorities), which selects; the PASK object itself holds only configuration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..classes import PROTECTION_ORDER, StructuralClass, class_index
from ..policy import Policy, compile_policy
from ..policy.groups import group_keep
from ..tagging.relevance import tool_relevance
from .base import LayerView, Method, MethodPlan, PrefillMode, StepRule
from .scored import KVzipStyle, prefix_end
from .snapkv import pool_scores

_ALL = list(StructuralClass)
_RANK = np.array([PROTECTION_ORDER.index(c) for c in _ALL])  # class index -> protection rank
_TAIL = [class_index(StructuralClass.QUERY), class_index(StructuralClass.TEMPLATE)]  # a held prompt tail's classes


@dataclass(frozen=True)
class Order:
    """A within-class order: which members of a class persist first (``worth``: higher first, all
    values distinct). ``name`` is the policy's ``within_class_order`` and the native rule's order."""

    name: str = "oldest-first"
    needs_attention: bool = False    # ranks by the observation window's attention: prefilled whole first
    reads_prompt_text: bool = False  # ranks by the prompt's words (bind gets the token texts)
    prompt_scorer: str = ""          # ranks by a scoring pass run before prefill (``engine.prescore``):
    instruction: str = ""            # bind gets its per-layer scores; what the pass reads with

    @property
    def query_aware(self) -> bool:
        """Whether the question's text (its words, or the attention its tokens pay) changes the order."""
        return self.needs_attention or self.reads_prompt_text

    def worth(self, pos: np.ndarray, all_classes: np.ndarray | None, scores: np.ndarray | None,
              prompt_len: int, priority: np.ndarray | None) -> np.ndarray:
        return pos.astype(np.float64)


@dataclass(frozen=True)
class NewestFirst(Order):
    name: str = "newest-first"

    def worth(self, pos, all_classes, scores, prompt_len, priority) -> np.ndarray:
        return (-pos).astype(np.float64)


@dataclass(frozen=True)
class SpanHead(Order):
    """Every span (a run of same-class tokens) loses its tail before any span loses its head."""

    name: str = "span-head"

    def worth(self, pos, all_classes, scores, prompt_len, priority) -> np.ndarray:
        if all_classes is not None and len(all_classes) > int(pos.max(initial=0)):
            return _span_head(pos, all_classes)
        return pos.astype(np.float64)  # no classes to find spans in: oldest-first


@dataclass(frozen=True)
class AttentionOrder(Order):
    """The tokens the observation window attends to most (pooled as SnapKV's) persist first."""

    name: str = "attention"
    needs_attention: bool = True
    kernel: int = 7  # score pooling, as SnapKV

    def worth(self, pos, all_classes, scores, prompt_len, priority) -> np.ndarray:
        if scores is None:
            raise RuntimeError("PASK with within_class_order 'attention' needs attention scores")
        pooled = pool_scores(pos, scores, self.kernel)
        return np.lexsort((pos, pooled)).argsort().astype(np.float64)  # rank; ties: newer first


@dataclass(frozen=True)
class ToolRelevance(Order):
    """Prompt positions by their tool's relevance to the query's words, then span-head; generated
    positions span-head."""

    name: str = "tool-relevance"
    reads_prompt_text: bool = True

    def worth(self, pos, all_classes, scores, prompt_len, priority) -> np.ndarray:
        if priority is None or len(priority) < prompt_len or all_classes is None:
            raise RuntimeError("PASK with within_class_order 'tool-relevance' needs the prompt's priorities "
                               "(bind with its pieces)")
        head = _span_head(pos, all_classes)
        if prompt_len == 0:
            return head
        return np.where(pos < prompt_len, priority[np.minimum(pos, max(0, prompt_len - 1))], head)


@dataclass(frozen=True)
class ReconstructionOrder(Order):
    """The entries a re-presentation of the part before the user's turn attends to most persist first
    (``kvzip``'s scoring pass: the same ``prompt_scorer`` and ``instruction``, so the two share one pass
    through its memo). Scores as they are (``kvzip`` pools nothing either); ties: newer first."""

    name: str = "reconstruction"
    prompt_scorer: str = KVzipStyle.prompt_scorer
    instruction: str = KVzipStyle.instruction

    def worth(self, pos, all_classes, scores, prompt_len, priority) -> np.ndarray:
        if scores is None:
            raise RuntimeError("PASK with within_class_order 'reconstruction' needs its scoring pass's scores "
                               "(bind with scores=)")
        return np.lexsort((pos, scores)).argsort().astype(np.float64)  # rank; ties: newer first


OLDEST_FIRST, NEWEST_FIRST, SPAN_HEAD = Order(), NewestFirst(), SpanHead()
ATTENTION, TOOL_RELEVANCE, RECONSTRUCTION = AttentionOrder(), ToolRelevance(), ReconstructionOrder()
ORDERS: dict[str, Order] = {o.name: o for o in (OLDEST_FIRST, NEWEST_FIRST, SPAN_HEAD, ATTENTION, TOOL_RELEVANCE,
                                                RECONSTRUCTION)}


class PASK(Method):
    scales_swa_capacity = False  # the compile step already counts sliding-window layers by their window

    def __init__(self, policy: Policy, swa_layers: tuple[int, ...] = (), window: int = 0,
                 recent: int = 32, hold_tail: bool = True, name: str | None = None) -> None:
        if name is not None:
            self.name = name  # a registered variant's name: what traces and stats report
        self.policy = policy
        self.hold_tail = hold_tail  # the prompt's question-and-header tail stays held while the call is written
        self.ranks = [_RANK if policy.residual == "weights" else _floor_ranks(f) for f in policy.floors]
        self.recent = recent
        self.swa_layers = swa_layers
        self.window = window
        self.group_of = policy.group_of_layer()

    # what the engine reads follows the policy's order (looked up when read: a policy edited after
    # construction, as the tests do, is what runs)
    @property
    def order(self) -> Order:
        return ORDERS[self.policy.within_class_order]

    @property
    def needs_attention(self) -> bool:  # type: ignore[override]
        return self.order.needs_attention

    @property
    def reads_prompt_text(self) -> bool:  # type: ignore[override]
        return self.order.reads_prompt_text

    @property
    def prompt_scorer(self) -> str:  # type: ignore[override]
        return self.order.prompt_scorer

    @property
    def instruction(self) -> str:
        return self.order.instruction

    @property
    def native_step(self) -> bool:  # type: ignore[override]
        # the native rule knows the structural orders only, not per-layer prompt scores
        return not self.order.prompt_scorer

    def obs_end(self, classes: np.ndarray) -> int:
        """A scoring pass reads prompt positions [0, obs_end): the part before the user's turn."""
        return prefix_end(classes)

    @property
    def prefill_mode(self) -> PrefillMode:  # type: ignore[override]
        # ranking by attention needs the observation window's statistic: the whole prompt first;
        # a structural order is decided before prefill
        return PrefillMode.WHOLE_THEN_COMPRESS if self.order.needs_attention else PrefillMode.PLANNED

    def bind(self, budget: float, classes: np.ndarray, n_layer: int, pieces: list[str] | None = None,
             scores: list[np.ndarray] | None = None, pooled: bool = True) -> PASKPlan:
        """Compile the policy for this prompt (class quotas per group, layer capacities). ``scores``:
        per layer, one per prompt position, for an order with a ``prompt_scorer`` (``engine.prescore``;
        a restored prefix's held marks come with ``pooled`` False: the order pools nothing either way)."""
        self.policy.check_model(n_layer)
        prompt_classes = np.array(classes, dtype=np.int64)
        counts = np.bincount(prompt_classes, minlength=len(_ALL))
        compiled = compile_policy(self.policy, budget, {c: int(counts[i]) for i, c in enumerate(_ALL)},
                                  self.swa_layers, self.window)
        # residual "attention" / "recent": the floors are the only quotas; attention / recency fills the rest
        keep = compiled.keep if self.policy.residual == "weights" else self.policy.floors
        order = self.order
        priority = None  # without pieces a tool-relevance plan sizes but cannot select (select says so)
        if order.reads_prompt_text and pieces is not None:
            priority = relevance_priority(tool_relevance(pieces, prompt_classes), prompt_classes)
        frozen = None
        if scores is not None and order.prompt_scorer:
            frozen = tuple(np.array(s, dtype=np.float64) for s in scores)  # its own copy: made read-only
        return PASKPlan(self, tuple(compiled.layer_capacity), tuple(compiled.warnings), priority,
                        keep=tuple(MappingProxyType(dict(k)) for k in keep), prompt_classes=prompt_classes,
                        order=order, prompt_scores=frozen)

    def capacities(self, budget: float, classes: np.ndarray, n_layer: int) -> list[int]:
        return list(self.bind(budget, classes, n_layer).capacities)

    def layer_keep(self, budget: float, n_layer: int) -> list[float] | None:
        """A policy with measured group curves (``group_budget``) gives each layer group its own share
        of the budget (``policy.groups.group_keep``, as ``compile_policy`` does for a prompt)."""
        pol = self.policy
        if pol.group_budget is None or pol.n_layer != n_layer or not 0.0 < budget <= 1.0:
            return None
        shares = group_keep(pol.group_budget, budget, [len(layers) for layers in pol.groups])
        keep = [budget] * n_layer
        for g, layers in enumerate(pol.groups):
            for il in layers:
                keep[il] = shares[g]
        return keep

    def select(self, view: LayerView, capacity: int) -> np.ndarray:
        raise RuntimeError("PASK selects through its plan: method.bind(budget, classes, n_layer).select(...)")

    def step_rule(self, layer: int, n_layer: int, prompt_len: int) -> StepRule:
        raise RuntimeError("PASK's step rule comes from its plan: method.bind(...).step_rule(...)")

    def report_groups(self, n_layer: int) -> list[list[int]]:
        return self.policy.groups

    def policy_json(self) -> dict:
        return self.policy.to_json()


@dataclass(frozen=True, eq=False)
class PASKPlan(MethodPlan):
    """PASK bound to one prompt: the compiled class shares per group (``keep``), the prompt's classes
    (the held tail), the order it ranks by and, for an order with a scoring pass, its per-layer scores."""

    keep: tuple[MappingProxyType, ...] = ()
    prompt_classes: np.ndarray | None = None
    order: Order = OLDEST_FIRST
    prompt_scores: tuple[np.ndarray, ...] | None = None

    def __post_init__(self) -> None:
        for a in (self.prompt_classes, self.priority, *(self.prompt_scores or ())):
            if a is not None:
                a.flags.writeable = False  # shared by every reader of the plan

    def select(self, view: LayerView, capacity: int) -> np.ndarray:
        m: PASK = self.method  # type: ignore[assignment]
        pos, cls = view.positions, view.classes
        if len(pos) <= capacity:
            return np.sort(pos)
        keep_frac = self.keep[m.group_of[view.layer]]
        rank = m.ranks[m.group_of[view.layer]]
        totals = np.bincount(view.all_classes if view.all_classes is not None else cls, minlength=len(_ALL))
        never = np.isin(cls, [class_index(c) for c in m.policy.never_evict])
        recent = never.copy()  # never-evict classes first, then the call being written, the tail, the newest
        n_gen = int((pos >= view.prompt_len).sum()) if view.prompt_len else 0
        tail_from = self.tail_from(view.prompt_len)
        n_tail = int((~never & (pos >= tail_from)).sum()) if tail_from >= 0 else 0
        n_recent = max(0, min(max(m.recent, n_gen, n_tail), capacity - int(never.sum())))
        if n_recent:
            others = np.flatnonzero(~never)
            recent[others[np.argsort(pos[others])[len(others) - n_recent:]]] = True
        kept = recent.copy()
        # higher persists first
        worth = self.order.worth(pos, view.all_classes, self._scores(view), view.prompt_len, self.priority)
        for ci in np.unique(cls):
            of_class = cls == ci
            members = np.flatnonzero(of_class & ~kept)
            c = _ALL[ci]
            target = int(of_class.sum()) if c in m.policy.never_evict else math.ceil(
                keep_frac[c] * totals[ci] - 1e-9)
            want = min(max(0, target - int((of_class & kept).sum())), len(members))
            if want:
                best = members[np.argsort(worth[members], kind="stable")[-want:]]
                kept[best] = True
        # rank: protection rank, then worth within the class
        if kept.sum() > capacity:
            idx = np.flatnonzero(kept & ~recent)
            order = np.lexsort((worth[idx], -rank[cls[idx]]))  # least protective, least worth first
            kept[idx[order[: kept.sum() - capacity]]] = False
        elif kept.sum() < capacity:
            idx = np.flatnonzero(~kept)
            order = np.lexsort((-worth[idx], rank[cls[idx]]))  # most protective, most worth first
            kept[idx[order[: capacity - kept.sum()]]] = True
        return np.sort(pos[kept])

    def _scores(self, view: LayerView) -> np.ndarray | None:
        """What the order ranks by: the view's statistic, or this layer's prompt scores (0 past the prompt)."""
        if self.prompt_scores is None:
            return view.scores
        layer = self.prompt_scores[view.layer]
        inside = view.positions < len(layer)
        out = np.zeros(len(view.positions))
        out[inside] = layer[view.positions[inside]]
        return out

    def step_rule(self, layer: int, n_layer: int, prompt_len: int) -> StepRule:
        m: PASK = self.method  # type: ignore[assignment]
        group = m.group_of[layer]
        keep_frac = self.keep[group]
        return StepRule("quota", recent=m.recent, protect_from=self.tail_from(prompt_len),
                        never=tuple(class_index(c) for c in m.policy.never_evict),
                        order=self.order.name,
                        keep=tuple(float(keep_frac[c]) for c in _ALL), rank=tuple(int(r) for r in m.ranks[group]))

    def tail_from(self, prompt_len: int) -> int:
        """The first position of the held prompt tail (-1: none): of the prompt's last ``recent``
        tokens, the final run of query and template tokens (the question and the assistant's header,
        which SnapKV's observation window also holds; not the end of a tool list)."""
        m: PASK = self.method  # type: ignore[assignment]
        cls = self.prompt_classes
        if not m.hold_tail or prompt_len <= 0 or cls is None or len(cls) < prompt_len:
            return -1
        start = max(0, prompt_len - m.recent)
        other = np.flatnonzero(~np.isin(cls[start:prompt_len], _TAIL))
        first = start + (int(other[-1]) + 1 if len(other) else 0)
        return first if first < prompt_len else -1


def _span_head(pos: np.ndarray, all_classes: np.ndarray) -> np.ndarray:
    """The span-head worth of ``pos``: a smaller offset in its span persists first; among equal
    offsets, the newer span."""
    return -span_offsets(all_classes)[pos].astype(np.float64) + pos / (pos.max(initial=0) + 1.0)


def relevance_priority(relevance: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """The ``tool-relevance`` order as one priority per prompt position (higher persists first, all
    distinct): its tool's relevance (in thousandths) first, then span-head (a smaller offset in its
    span first; among equal offsets the newer span)."""
    n = len(classes)
    rel = np.round(np.clip(np.asarray(relevance, dtype=np.float64), 0.0, 1.0) * 1000.0)
    return rel * 1e6 - span_offsets(np.asarray(classes, dtype=np.int64)) + np.arange(n) / (n + 1.0)


def _floor_ranks(floors: dict[StructuralClass, float]) -> np.ndarray:
    """Protection ranks when attention fills the residual: classes with a floor keep their
    ``PROTECTION_ORDER`` rank; every other class shares the one rank after them."""
    return np.array([_RANK[i] if floors.get(c, 0.0) > 0.0 else len(_ALL) for i, c in enumerate(_ALL)])


def span_offsets(classes: np.ndarray) -> np.ndarray:
    """For each position, its index inside its span (the run of equal classes it belongs to)."""
    n = len(classes)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    idx = np.arange(n)
    start = np.r_[True, classes[1:] != classes[:-1]]
    return idx - np.maximum.accumulate(np.where(start, idx, 0))


def class_indices(classes: list[StructuralClass]) -> np.ndarray:
    return np.array([class_index(c) for c in classes], dtype=np.int64)
