"""Fits a calibrated persistence policy from per-case signal measurements (the documented rules).

Input: per-case records of ``signals.measure_case`` (``dnll`` and ``distortion`` per (group, class)).
Each (group g, class c) cell is summarised over the cases where c is present: mean and standard
error of the NLL increase, mean distortion per evicted token.

Floors (task-error sensitivity), from a mean NLL increase ``d`` (nats per gold token):
  floor = ``floor_hi`` (1.0) if d >= ``tau_hi``; ``floor_lo`` (0.5) if d >= ``tau_lo``; else 0.
When the records carry joint measurements (the class evicted in every layer at once;
``signals.measure_joint``), ``d`` is the class's joint increase and the floor starts in every group:
the joint signal says whether a class must persist at all, which single-group evictions can miss
when groups back each other up. Records without them (older caches) fall back to the per-cell ``d``.
Floor cap: the floors must leave room under small budgets. Their expected KV mass, the sum over
cells of floor x (share of c in the calib sequences) x (share of layers in g), plus the sinks, is
kept <= ``floor_cap`` (generated classes do not count: the engine keeps the call being written
first whatever the policy): while it is above, the floored cell with the least single-group NLL increase
per unit of KV mass it protects steps down one level (1.0 -> 0.5 -> 0): protection leaves first
the groups where losing the class hurts least. Every step is listed in the provenance.
Weights (attention-output distortion): weight = mean distortion per evicted token / the largest
such mean over all cells, at least ``min_weight``; a class never seen in calibration gets
``min_weight`` in every group. Records of the native signal (``native_signals``: llama.cpp does not
expose the attention outputs there) carry no distortion; their cells weigh by the NLL increase per
evicted token instead (negative increases count as 0), ``provenance["weight_signal"]`` says which. The engine's compile step then water-fills the budget left after
the floors by these weights (``pask_local.policy.compile``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pask_local.classes import StructuralClass
from pask_local.errors import PaskError
from pask_local.policy.groups import GroupCurves
from pask_local.policy.schema import Policy

NEVER_EVICT = (StructuralClass.SINK,)
# not measured: a design choice (docs/policy-format.md); span-head agreed with Full KV more often on the calib split
WITHIN_CLASS_ORDER = "span-head"


class FitError(PaskError):
    """Bad fit thresholds or no usable measurements."""


@dataclass
class FitRule:
    tau_hi: float = 0.10          # nats per gold token: full floor at or above
    tau_lo: float = 0.03          # half floor at or above
    floor_hi: float = 1.0
    floor_lo: float = 0.5
    floor_cap: float = 0.15       # max expected KV share held by floors (incl. sinks)
    min_weight: float = 0.02

    def check(self) -> None:
        if not 0 <= self.tau_lo <= self.tau_hi:
            raise FitError(f"need 0 <= tau_lo ({self.tau_lo}) <= tau_hi ({self.tau_hi})")
        if not 0 <= self.floor_lo <= self.floor_hi <= 1:
            raise FitError("need 0 <= floor_lo <= floor_hi <= 1")
        if not 0 < self.floor_cap <= 1:
            raise FitError(f"floor_cap must be in (0, 1], got {self.floor_cap}")
        if not 0 <= self.min_weight <= 1:
            raise FitError(f"min_weight must be in [0, 1], got {self.min_weight}")


@dataclass
class Cell:
    dnll: float
    dnll_sem: float
    distortion: float
    n_cases: int


def weight_signal(cell: dict[str, Any]) -> float:
    """A cell's weight signal: its distortion per evicted token, or (native records, no distortion)
    its NLL increase per evicted token, at least 0."""
    if cell.get("distortion") is not None:
        return float(cell["distortion"])
    return max(0.0, float(cell["dnll"])) / max(1, int(cell.get("n_evicted") or 1))


def summarise(records: Sequence[dict[str, Any]], n_groups: int) -> dict[tuple[int, StructuralClass], Cell]:
    """(group, class) -> Cell over the records where the class was measured."""
    acc: dict[tuple[int, StructuralClass], tuple[list[float], list[float]]] = {}
    for rec in records:
        for cell in rec["cells"]:
            g = int(cell["group"])
            if not 0 <= g < n_groups:
                raise FitError(f"case {rec.get('id')}: group {g} outside 0..{n_groups - 1}")
            key = (g, StructuralClass(cell["class"]))
            d, x = acc.setdefault(key, ([], []))
            d.append(float(cell["dnll"]))
            x.append(weight_signal(cell))
    return {key: _cell(d, x) for key, (d, x) in acc.items()}


def summarise_joint(records: Sequence[dict[str, Any]]) -> dict[StructuralClass, Cell]:
    """class -> Cell of the joint (every-layer) eviction, over the records that measured it."""
    acc: dict[StructuralClass, tuple[list[float], list[float]]] = {}
    for rec in records:
        for cell in rec.get("joint") or []:
            d, x = acc.setdefault(StructuralClass(cell["class"]), ([], []))
            d.append(float(cell["dnll"]))
            x.append(weight_signal(cell))
    return {c: _cell(d, x) for c, (d, x) in acc.items()}


def _cell(dnll: list[float], distortion: list[float]) -> Cell:
    """Mean and standard error of the NLL increases, mean distortion, over the measured cases."""
    n = len(dnll)
    mean = sum(dnll) / n
    sem = math.sqrt(sum((v - mean) ** 2 for v in dnll) / (n - 1) / n) if n > 1 else float("nan")
    return Cell(mean, sem, sum(distortion) / n, n)


def class_shares(records: Sequence[dict[str, Any]]) -> dict[StructuralClass, float]:
    """Mean share of each class among all tokens (prompt + gold call) of the records."""
    shares = {c: 0.0 for c in StructuralClass}
    for rec in records:
        total = sum(rec["counts"].values())
        for name, n in rec["counts"].items():
            shares[StructuralClass(name)] += n / total / len(records)
    return shares


def floor_mass(floors: list[dict[StructuralClass, float]], groups: list[list[int]],
               shares: dict[StructuralClass, float]) -> float:
    """Expected share of full KV that ``floors`` hold (never-evicted classes count as floor 1).
    Generated classes are left out: the engine keeps the call being written first whatever the
    policy (methods/pask.py), so their floors take nothing from the prompt's protection."""
    n_layer = sum(len(g) for g in groups)
    mass = 0.0
    for g, layers in enumerate(groups):
        for c, share in shares.items():
            if c.is_generated:
                continue
            f = 1.0 if c in NEVER_EVICT else floors[g].get(c, 0.0)
            mass += f * share * len(layers) / n_layer
    return mass


def fit_group_curves(records: Sequence[dict[str, Any]], n_groups: int) -> tuple[GroupCurves, int] | None:
    """The mean group budget curves over the records that carry them (``native_signals.measure_group_curves``),
    with how many records that is; None when none does. Every record must use the same levels."""
    have = [r for r in records if r.get("group_curves")]
    if not have:
        return None
    sums: dict[tuple[int, float], list[float]] = {}
    for rec in have:
        for cell in rec["group_curves"]:
            g = int(cell["group"])
            if not 0 <= g < n_groups:
                raise FitError(f"case {rec.get('id')}: group {g} outside 0..{n_groups - 1}")
            sums.setdefault((g, float(cell["keep"])), []).append(float(cell["dnll"]))
    levels = sorted({k for _, k in sums})
    if any(len(sums.get((g, k), ())) != len(have) for g in range(n_groups) for k in levels):
        raise FitError("the cached group curves were measured at different levels; measure them again")
    curves = tuple(tuple(sum(sums[(g, k)]) / len(have) for k in levels) for g in range(n_groups))
    return GroupCurves(tuple(levels), curves), len(have)


def fit_policy(records: Sequence[dict[str, Any]], groups: list[list[int]], rule: FitRule,
               provenance: dict[str, Any], group_curves: bool = False, group_min_share: float = 0.0) -> Policy:
    """The calibrated Policy (see the module docstring for the rules); ``group_curves``: with the mean
    group budget curves of the records (``fit_group_curves``) as its ``group_budget``, no group below
    ``group_min_share`` times the budget."""
    rule.check()
    if not records:
        raise FitError("no measured cases to fit a policy from")
    n_groups = len(groups)
    n_layer = sum(len(g) for g in groups)
    cells = summarise(records, n_groups)
    shares = class_shares(records)

    joint = summarise_joint(records) if all(rec.get("joint") for rec in records) else {}

    def tier(d: float) -> float:
        return rule.floor_hi if d >= rule.tau_hi else rule.floor_lo if d >= rule.tau_lo else 0.0

    floors = [{c: 0.0 for c in StructuralClass} for _ in groups]
    if joint:
        for c, jc in joint.items():
            for g in range(n_groups):
                floors[g][c] = tier(jc.dnll)
    else:
        for (g, c), cell in cells.items():
            floors[g][c] = tier(cell.dnll)
    demoted = []
    while floor_mass(floors, groups, shares) > rule.floor_cap + 1e-12:
        floored = [(g, c) for g in range(n_groups) for c in StructuralClass
                   if floors[g][c] > 0 and c not in NEVER_EVICT and not c.is_generated]
        if not floored:
            break

        def value(key: tuple[int, StructuralClass]) -> float:
            g, c = key
            cost = shares[c] * len(groups[g]) / n_layer
            d = cells[key].dnll if key in cells else 0.0
            return d / cost if cost > 0 else math.inf

        g, c = min(floored, key=value)
        new = rule.floor_lo if floors[g][c] > rule.floor_lo else 0.0
        demoted.append({"group": g, "class": c.value, "from": floors[g][c], "to": new})
        floors[g][c] = new

    top = max((cell.distortion for cell in cells.values()), default=0.0)
    weights = [{c: rule.min_weight for c in StructuralClass} for _ in groups]
    for (g, c), cell in cells.items():
        weights[g][c] = max(rule.min_weight, cell.distortion / top) if top > 0 else rule.min_weight
    for c in NEVER_EVICT:
        for g in range(n_groups):
            floors[g][c] = 1.0

    prov = dict(provenance)
    prov["fit_rule"] = {**asdict(rule), "statistic": "mean over calib cases where the class is present",
                        "doc": "calibration/policy_fit.py"}
    prov["floor_mass"] = round(floor_mass(floors, groups, shares), 4)
    prov["floor_cap_demotions"] = demoted
    prov["floor_signal"] = "joint" if joint else "per-group"
    native = any(c.get("distortion") is None for rec in records for c in rec["cells"])
    prov["weight_signal"] = "dnll per evicted token" if native else "attention-output distortion per evicted token"
    prov["joint_measurements"] = [
        {"class": c.value, "dnll_mean": round(jc.dnll, 5), "dnll_sem": _r(jc.dnll_sem), "n_cases": jc.n_cases}
        for c, jc in sorted(joint.items(), key=lambda kv: list(StructuralClass).index(kv[0]))]
    prov["class_shares"] = {c.value: round(s, 4) for c, s in shares.items() if s > 0}
    prov["measurements"] = [
        {"group": g, "class": c.value, "dnll_mean": round(cell.dnll, 5), "dnll_sem": _r(cell.dnll_sem),
         "distortion_mean": round(cell.distortion, 6), "n_cases": cell.n_cases}
        for (g, c), cell in sorted(cells.items(), key=lambda kv: (kv[0][0], list(StructuralClass).index(kv[0][1])))
    ]
    curves = None
    if group_curves:
        fitted = fit_group_curves(records, n_groups)
        if fitted is None:
            raise FitError("no measured group curves to fit (calibrate --group-curves measures them)")
        curves, n_curves = fitted
        curves = dataclasses.replace(curves, min_share=group_min_share)
        prov["group_budget"] = {"n_cases": n_curves, "measured_with": "the hand-written prior's rule, one group "
                                "at a time (calibration/native_signals.py: measure_group_curves)",
                                "min_share": group_min_share}
    return Policy(groups=groups, floors=floors, weights=[{c: round(w, 4) for c, w in t.items()} for t in weights],
                  kind="calibrated", within_class_order=WITHIN_CLASS_ORDER, never_evict=NEVER_EVICT,
                  provenance=prov, group_budget=curves)


def _r(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 5)


def summary_rows(policy: Policy) -> tuple[list[list[str]], list[list[str]]]:
    """Two tables' rows (one per measured class, one column per group) from a calibrated policy:
    'dNLL / distortion per token' and 'floor / weight'."""
    meas = {(m["group"], m["class"]): m for m in policy.provenance.get("measurements", [])}
    measured, fitted = [], []
    for c in StructuralClass:
        if not any((g, c.value) in meas for g in range(policy.n_groups)):
            continue
        mrow, frow = [c.value], [c.value]
        for g in range(policy.n_groups):
            m = meas.get((g, c.value))
            mrow.append(f"{m['dnll_mean']:+.3f} / {m['distortion_mean']:.4f}" if m else "-")
            frow.append(f"{policy.floors[g][c]:.1f} / {policy.weights[g][c]:.2f}")
        measured.append(mrow)
        fitted.append(frow)
    return measured, fitted
