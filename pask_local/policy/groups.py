"""How a KV budget is split between layer groups: measured sensitivity curves, one allocation per budget.

A policy may carry ``group_budget``: for each layer group g, the task error (mean NLL increase of the
gold call, nats per token) when g alone keeps a share ``k`` of the prompt (by the policy's own rule)
while every other layer keeps it all, measured at a few levels ``k`` by ``pask-local calibrate
--group-curves``. Between the levels the error is interpolated linearly, at ``k = 1`` it is 0, and it
is made non-increasing in ``k`` (keeping more never hurts: a measured rise is noise).

``group_keep`` chooses each group's share ``k_g`` so that the layers' mean share is the budget and the
summed errors are the least (groups taken as independent: the curves are measured one group at a time),
by dynamic programming over shares in steps of ``STEP``, never below the lowest measured level nor below
``min_share`` times the budget. That floor exists because the groups are not independent: on
Qwen2.5-Coder-1.5B the curves say the first two groups lose almost nothing at 5% each, yet both at 5%
together cost 14 points on the calibration split at budget 0.2 (docs/results.md); 0.5 (no group below
half the budget) was chosen there. This runs when a request's budget is compiled: a lookup over a few
groups, not a measurement.

Without curves every layer gets the budget (the compile step's allocation over classes then decides
what each group keeps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

STEP = 0.01  # the allocation's resolution (share of a group's prompt)


@dataclass(frozen=True)
class GroupCurves:
    levels: tuple[float, ...]              # increasing shares in (0, 1), where the curves were measured
    dnll: tuple[tuple[float, ...], ...]    # per group: the NLL increase at each level
    min_share: float = 0.0                 # no group keeps less than this fraction of the budget

    def error(self, g: int, k: float) -> float:
        """Group g's interpolated, non-increasing error at share ``k`` (0 at k >= 1)."""
        pts = list(zip(self.levels, _non_increasing(self.dnll[g]), strict=True)) + [(1.0, 0.0)]
        if k <= pts[0][0]:
            return pts[0][1]
        for (k0, d0), (k1, d1) in zip(pts, pts[1:], strict=False):
            if k <= k1:
                return d0 + (d1 - d0) * (k - k0) / (k1 - k0)
        return 0.0

    def to_json(self) -> dict:
        out: dict = {"levels": list(self.levels), "dnll": [list(d) for d in self.dnll]}
        if self.min_share:
            out["min_share"] = self.min_share
        return out


def _non_increasing(values: Sequence[float]) -> list[float]:
    """The values lowered where needed so that none is above one before it (keeping more never hurts)."""
    out, low = [], math.inf
    for v in values:
        low = min(low, max(0.0, v))
        out.append(low)
    return out


def group_keep(curves: GroupCurves, budget: float, sizes: Sequence[float]) -> list[float]:
    """Each group's share of the prompt: sum(sizes[g] * k_g) == budget * sum(sizes) (up to STEP), the
    summed error least; every k_g in [lowest level, 1]. ``sizes``: each group's (effective) layer count."""
    n = len(sizes)
    if n != len(curves.dnll):
        raise ValueError(f"{len(curves.dnll)} group curves for {n} groups")
    lo = max(curves.levels[0], min(1.0, curves.min_share * budget))
    if budget <= lo:  # the budget is below every measured level: all groups get it
        return [budget] * n
    if budget >= 1.0:
        return [1.0] * n
    grid = [round(lo + i * STEP, 6) for i in range(int(math.floor((1.0 - lo) / STEP + 1e-9)) + 1)]
    # layer-share units: group g at share k costs sizes[g] * k; the total is budget * sum(sizes)
    total = budget * sum(sizes)
    # dp over groups: best[(used rounded to STEP units)] = (error, choices)
    unit = STEP * min(sizes)
    best: dict[int, tuple[float, tuple[float, ...]]] = {0: (0.0, ())}
    for g in range(n):
        nxt: dict[int, tuple[float, tuple[float, ...]]] = {}
        for used, (err, picks) in best.items():
            for k in grid:
                u = used + int(round(sizes[g] * k / unit))
                if u * unit > total + 1e-9:
                    break
                e = err + curves.error(g, k)
                if u not in nxt or e < nxt[u][0] - 1e-12:
                    nxt[u] = (e, (*picks, k))
        best = nxt
        if not best:  # even the lowest level in every group exceeds the budget
            return [budget] * n
    # the least error among the allocations that spend (nearly) the whole budget
    target = int(round(total / unit))
    spend = [u for u in best if u >= target - int(round(max(sizes) / unit))]
    u = min(spend or best, key=lambda x: (best[x][0], -x))
    picks = list(best[u][1])
    # the remainder left by the grid goes to every group in proportion (the budget is met exactly)
    used = sum(s * k for s, k in zip(sizes, picks, strict=True))
    if used > 0 and used < total:
        scale = total / used
        picks = [min(1.0, k * scale) for k in picks]
    return picks
