"""Compile a persistence policy + a KV budget into per-(group, class) keep fractions and per-layer capacities.

Budget accounting: the budget B is a fraction of the KV entries that full KV would hold for the
same model and input, summed over all layers. A global-attention layer's full size is N (tokens in
the sequence); a sliding-window layer's is min(N, W): such a layer counts as min(N, W)/N of a layer.

Allocation: the floors are granted first (floor[g][c] * N_c tokens in every layer of group g); the
capacity left is then water-filled by weight: every cell (g, c) receives
min(1 - floor, lambda * weight) of its tokens, with one lambda chosen so that the total meets the
budget exactly (cells whose weight is 0 receive nothing beyond their floor). Classes in
``never_evict`` are kept whole. If the floors alone exceed B, **the budget wins**: the floors of the
least protective classes (``PROTECTION_ORDER``, from the end) are lowered first, each class in every
group at once, the last one only as far as needed, and the result says so with a warning. (Before,
the floors won: at B = 0.2 the hand-written prior held 0.29 of Full KV on Qwen2.5-Coder's native
prompts, which made it look better than methods that held 0.2.)
With ``group_budget`` curves in the policy (``policy/groups.py``) the budget is first split between
the layer groups (each group its measured best share, the layers' mean share the budget), and the
floors-then-weights allocation runs inside each group on its own share (a group's floors give way
only to its own share).
Online, only the result of this step is looked up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..classes import PROTECTION_ORDER, StructuralClass
from .groups import group_keep
from .schema import Policy


@dataclass
class CompiledPolicy:
    budget: float
    effective_budget: float
    keep: list[dict[StructuralClass, float]]          # per group: fraction of class tokens kept
    layer_capacity: list[int]                          # KV cells per layer for the counted tokens
    full_entries: float
    granted_entries: float
    warnings: list[str] = field(default_factory=list)

    def keep_count(self, group: int, cls: StructuralClass, n_tokens: int) -> int:
        """How many of ``n_tokens`` tokens of class ``cls`` group ``group`` keeps (rounded up)."""
        return min(n_tokens, math.ceil(self.keep[group][cls] * n_tokens - 1e-9))


def layer_weights(n_layer: int, n_tokens: int, swa_layers: Sequence[int] = (), window: int = 0) -> list[float]:
    """Each layer's full-KV size relative to a global layer (1.0, or min(N, W)/N for SWA layers)."""
    swa = set(swa_layers)
    if n_tokens <= 0:
        return [1.0] * n_layer
    return [min(n_tokens, window) / n_tokens if (il in swa and window > 0) else 1.0 for il in range(n_layer)]


def compile_policy(policy: Policy, budget: float, class_counts: Mapping[StructuralClass, int],
                   swa_layers: Sequence[int] = (), window: int = 0) -> CompiledPolicy:
    """Allocate ``budget`` (fraction of full KV entries) over (group, class) cells; see module doc."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    n_tokens = sum(class_counts.values())
    lw = layer_weights(policy.n_layer, n_tokens, swa_layers, window)
    gsize = [sum(lw[il] for il in layers) for layers in policy.groups]  # effective layers per group
    full = n_tokens * sum(lw)
    target = budget * full

    floors: list[dict[StructuralClass, float]] = []
    for g in range(policy.n_groups):
        f = {}
        for c in StructuralClass:
            f[c] = 1.0 if c in policy.never_evict else policy.floors[g].get(c, 0.0)
        floors.append(f)

    def cost(g: int, c: StructuralClass, frac: float) -> float:
        return frac * class_counts.get(c, 0) * gsize[g]

    warnings: list[str] = []
    keep = [dict(f) for f in floors]
    if policy.group_budget is None:  # one allocation over every (group, class) cell
        parts = [(list(range(policy.n_groups)), target)]
    else:  # each group its own share of the budget (the measured curves), then its own allocation
        shares = group_keep(policy.group_budget, budget, gsize)
        parts = [([g], shares[g] * n_tokens * gsize[g]) for g in range(policy.n_groups)]
    for part, part_target in parts:
        need = sum(cost(g, c, floors[g][c]) for g in part for c in StructuralClass)  # before any lowering
        lowered = _allocate(part, keep, floors, policy, class_counts, gsize, cost, part_target)
        if not lowered:
            continue
        names = ", ".join(c.value for c in lowered)
        if policy.group_budget is None:
            warnings.append(f"protection floors alone need {need / full if full else 1.0:.3f} of full KV, above "
                            f"the budget {budget:.3f}: lowered the floors of {names} to hold it")
        else:
            g = part[0]
            share = part_target / (n_tokens * gsize[g]) if n_tokens * gsize[g] else 1.0
            warnings.append(f"protection floors alone need {need / (n_tokens * gsize[g]):.3f} of group {g}'s full "
                            f"KV, above its share {share:.3f} of the budget {budget:.3f}: lowered the floors of "
                            f"{names} to hold it")

    granted = sum(cost(g, c, keep[g][c]) for g in range(policy.n_groups) for c in StructuralClass)
    capacity = [0] * policy.n_layer
    for g, layers in enumerate(policy.groups):
        for il in layers:
            entries = sum(keep[g][c] * class_counts.get(c, 0) for c in StructuralClass) * lw[il]
            capacity[il] = min(max(1, math.ceil(entries - 1e-9)), n_tokens if lw[il] == 1.0 else
                               max(1, math.ceil(n_tokens * lw[il])))
    return CompiledPolicy(budget=budget, effective_budget=(granted / full if full else 1.0), keep=keep,
                          layer_capacity=capacity, full_entries=full, granted_entries=granted,
                          warnings=warnings)


def _allocate(part: list[int], keep: list[dict[StructuralClass, float]],
              floors: list[dict[StructuralClass, float]], policy: Policy, class_counts: Mapping[StructuralClass, int],
              gsize: list[float], cost, target: float) -> list[StructuralClass]:
    """Fill ``keep[g]`` for the groups of ``part`` with ``target`` entries: the floors (lowered in place,
    least protective class first, when they alone exceed it), then the rest water-filled by weight,
    then what is still unused spread evenly over the cells without weight. Returns the lowered classes."""
    floor_entries = sum(cost(g, c, floors[g][c]) for g in part for c in StructuralClass)
    residual = target - floor_entries
    lowered: list[StructuralClass] = []
    if residual < -1e-9:
        lowered = _lower_floors(floors, policy.never_evict, cost, floor_entries - target, part)
        for g in part:
            keep[g] = dict(floors[g])
    elif residual > 0:
        cells = [(g, c) for g in part for c in StructuralClass
                 if class_counts.get(c, 0) > 0 and floors[g][c] < 1.0 and policy.weights[g].get(c, 0.0) > 0]
        filled = _water_fill(cells, floors, [dict(w) for w in policy.weights], class_counts, gsize, residual)
        left = residual - sum(cost(g, c, filled[g][c] - floors[g][c]) for g, c in cells)
        # Capacity still unused (every weighted cell is whole): spread it evenly over the cells
        # the policy gave no weight, so PASK never holds less than the budget allows.
        rest = [(g, c) for g in part for c in StructuralClass
                if class_counts.get(c, 0) > 0 and filled[g][c] < 1.0 and (g, c) not in cells]
        if left > 1e-9 and rest:
            uniform = [{c: 1.0 for c in StructuralClass} for _ in range(policy.n_groups)]
            filled = _water_fill(rest, filled, uniform, class_counts, gsize, left)
        for g in part:
            keep[g] = filled[g]
    return lowered


def _lower_floors(floors: list[dict[StructuralClass, float]], never: Sequence[StructuralClass], cost,
                  excess: float, part: list[int]) -> list[StructuralClass]:
    """Lower ``floors`` in place by ``excess`` entries, least protective class first (a class in all
    groups of ``part`` at once, scaled by one factor; the last class touched only as far as needed)."""
    lowered = []
    for c in reversed(PROTECTION_ORDER):
        if excess <= 1e-9:
            break
        if c in never:
            continue
        have = sum(cost(g, c, floors[g][c]) for g in part)
        if have <= 0:
            continue
        scale = max(0.0, 1.0 - excess / have)
        for g in part:
            floors[g][c] *= scale
        excess -= have * (1.0 - scale)
        lowered.append(c)
    return lowered


def _water_fill(cells, floors, weights, counts, gsize, residual: float):
    """Find lambda with sum over cells of min(1 - floor, lambda * w) * N_c * |g| == residual."""
    keep = [dict(f) for f in floors]

    def used(lam: float) -> float:
        return sum(min(1.0 - floors[g][c], lam * weights[g][c]) * counts[c] * gsize[g] for g, c in cells)

    if not cells:
        return keep
    hi = max((1.0 - floors[g][c]) / weights[g][c] for g, c in cells)
    if used(hi) <= residual:  # everything fits: keep all tokens of weighted cells
        lam = hi
    else:
        lo = 0.0
        for _ in range(100):
            mid = (lo + hi) / 2
            if used(mid) > residual:
                hi = mid
            else:
                lo = mid
        lam = lo
    for g, c in cells:
        keep[g][c] = floors[g][c] + min(1.0 - floors[g][c], lam * weights[g][c])
    return keep
