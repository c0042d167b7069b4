"""The hand-written starting policy: protect what a call cannot be rebuilt without.

Sinks, tool names, required parameter names, the user's query, generated names and keys and
required values get full floors; tool results (what a call returned, the values an answer quotes)
are mostly protected; template tokens, types and optional names are half protected;
descriptions, schema punctuation and whitespace go first. The same table is used for every layer
group: it is a prior, to be replaced by measured (calibrated) policies. Within a class, spans lose
their tails first (``span-head``): every tool keeps the start of its description.

``hybrid_policy`` is the floors-only table of the ``pask-hybrid`` variant: what a call cannot be
rebuilt without (tool names, required parameter names, the query, the call being written)
persists whole in every group; the rest of the budget goes to the tokens attention ranks highest.
``floors_policy`` keeps the same floors and gives the rest to the newest tokens (no attention, no
class shares): structural protection plus a recent window.
"""

from __future__ import annotations

from ..classes import StructuralClass as C
from .schema import Policy, contiguous_groups

FLOORS: dict[C, float] = {
    C.SINK: 1.0, C.TOOL_NAME: 1.0, C.PARAM_REQUIRED: 1.0, C.QUERY: 1.0,
    C.GEN_NAME: 1.0, C.GEN_KEY: 1.0, C.GEN_VALUE_REQUIRED: 1.0,
    C.PARAM_NAME: 0.7, C.TOOL_RESULT: 0.7, C.TEMPLATE: 0.5, C.GEN_VALUE_OPTIONAL: 0.7, C.PARAM_TYPE: 0.3,
    C.GEN_STRUCT: 0.3,
}
WEIGHTS: dict[C, float] = {
    C.PARAM_NAME: 1.0, C.TOOL_RESULT: 1.0, C.TEMPLATE: 0.8, C.GEN_VALUE_OPTIONAL: 1.0, C.PARAM_TYPE: 0.8,
    C.GEN_STRUCT: 0.6, C.EXAMPLE: 0.4, C.DESCRIPTION: 0.3, C.SCHEMA_PUNCT: 0.2, C.GEN_WS: 0.1,
}


def handwritten_policy(n_layer: int, n_groups: int = 4) -> Policy:
    groups = contiguous_groups(n_layer, n_groups)
    return Policy(
        groups=groups,
        floors=[{c: FLOORS.get(c, 0.0) for c in C} for _ in groups],
        weights=[{c: WEIGHTS.get(c, 0.0) for c in C} for _ in groups],
        kind="hand-written",
        within_class_order="span-head",
        provenance={"note": "hand-written prior (pask_local/policy/handwritten.py); not measured"},
    )


# pask-hybrid: kept whole in every layer group; everything else is ranked by attention
# Optional parameter names are not floored: kept without their descriptions and defaults they led the
# model to fill optional arguments it should have left out (chosen on the calibration split)
HYBRID_FLOORS: tuple[C, ...] = (C.SINK, C.TOOL_NAME, C.PARAM_REQUIRED, C.QUERY,
                                C.GEN_NAME, C.GEN_KEY, C.GEN_VALUE_REQUIRED)


def hybrid_policy(n_layer: int, n_groups: int = 4) -> Policy:
    groups = contiguous_groups(n_layer, n_groups)
    return Policy(
        groups=groups,
        floors=[{c: (1.0 if c in HYBRID_FLOORS else 0.0) for c in C} for _ in groups],
        weights=[{c: (0.0 if c in HYBRID_FLOORS else 1.0) for c in C} for _ in groups],
        kind="hand-written",
        within_class_order="attention",
        residual="attention",
        provenance={"note": "pask-hybrid floors (pask_local/policy/handwritten.py); not measured"},
    )


def floors_policy(n_layer: int, n_groups: int = 4) -> Policy:
    """The ``floors`` variant: ``HYBRID_FLOORS`` kept whole; the rest of the budget to the newest tokens."""
    groups = contiguous_groups(n_layer, n_groups)
    return Policy(
        groups=groups,
        floors=[{c: (1.0 if c in HYBRID_FLOORS else 0.0) for c in C} for _ in groups],
        weights=[{c: (0.0 if c in HYBRID_FLOORS else 1.0) for c in C} for _ in groups],
        kind="hand-written",
        within_class_order="newest-first",
        residual="recent",
        provenance={"note": "floors only (pask_local/policy/handwritten.py); not measured"},
    )
