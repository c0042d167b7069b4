"""Policy fitting rules (floors from NLL increase, floor cap, weights from distortion) and the
mapping of a calibrated policy to another layer count by relative depth."""

from __future__ import annotations

import pytest
from pask_local.calibration.policy_fit import (
    FitError,
    FitRule,
    class_shares,
    fit_policy,
    floor_mass,
    summarise,
)

from pask_local.classes import StructuralClass as C
from pask_local.policy.compile import compile_policy
from pask_local.policy.schema import Policy, contiguous_groups

GROUPS = [[0, 1], [2, 3]]


def record(cid: str, cells: dict[tuple[int, str], tuple[float, float]], counts: dict[str, int]) -> dict:
    return {"id": cid, "category": "simple_python", "counts": counts,
            "cells": [{"group": g, "class": c, "dnll": d, "distortion": x} for (g, c), (d, x) in cells.items()]}


COUNTS = {"sink": 1, "query": 10, "description": 40, "tool_name": 4, "gen_struct": 10, "template": 35}


def two_cases(query=(0.30, 0.02), desc=(0.001, 0.001), tool=(0.05, 0.01), gen=(0.12, 0.04), tmpl=(-0.02, 0.002)):
    """Two cases whose mean cell values are exactly the given (dnll, distortion) pairs."""
    recs = []
    for sign in (+1, -1):
        cells = {}
        for g in (0, 1):
            for cls, (d, x) in (("query", query), ("description", desc), ("tool_name", tool),
                                ("gen_struct", gen), ("template", tmpl)):
                cells[(g, cls)] = (d + sign * 0.01, x)
        recs.append(record(f"c{sign}", cells, COUNTS))
    return recs


def test_floors_follow_the_thresholds():
    pol = fit_policy(two_cases(), GROUPS, FitRule(tau_hi=0.10, tau_lo=0.03, floor_cap=1.0), {"model_sha256": "x"})
    assert pol.kind == "calibrated"
    for g in (0, 1):
        assert pol.floors[g][C.QUERY] == 1.0          # 0.30 >= tau_hi
        assert pol.floors[g][C.GEN_STRUCT] == 1.0     # 0.12
        assert pol.floors[g][C.TOOL_NAME] == 0.5      # 0.05 in [tau_lo, tau_hi)
        assert pol.floors[g][C.DESCRIPTION] == 0.0
        assert pol.floors[g][C.TEMPLATE] == 0.0       # negative increase
        assert pol.floors[g][C.SINK] == 1.0           # never evicted
    # the same data with other thresholds moves the cells
    pol2 = fit_policy(two_cases(), GROUPS, FitRule(tau_hi=0.5, tau_lo=0.2, floor_cap=1.0), {})
    assert pol2.floors[0][C.QUERY] == 0.5 and pol2.floors[0][C.GEN_STRUCT] == 0.0


def with_joint(recs, joint: dict[str, float]):
    """The records, each also carrying joint (every-layer) measurements with these mean dNLLs."""
    return [{**r, "joint": [{"class": c, "dnll": d, "distortion": 0.0} for c, d in joint.items()]} for r in recs]


def test_joint_signal_sets_floors_in_every_group():
    # single-group increases say nothing matters; the joint ones say query and tool names do
    recs = with_joint(two_cases(query=(0.005, 0.02), tool=(0.002, 0.01), gen=(0.0, 0.04)),
                      {"query": 0.3, "tool_name": 0.05, "description": 0.01, "template": 0.0, "gen_struct": 0.2})
    pol = fit_policy(recs, GROUPS, FitRule(tau_hi=0.10, tau_lo=0.03, floor_cap=1.0), {})
    assert pol.provenance["floor_signal"] == "joint"
    for g in (0, 1):
        assert pol.floors[g][C.QUERY] == 1.0 and pol.floors[g][C.TOOL_NAME] == 0.5
        assert pol.floors[g][C.DESCRIPTION] == 0.0 and pol.floors[g][C.TEMPLATE] == 0.0
    assert {m["class"] for m in pol.provenance["joint_measurements"]} >= {"query", "tool_name"}
    # without joint measurements the same cells give no floors (per-group fallback)
    per_group = fit_policy(two_cases(query=(0.005, 0.02), tool=(0.002, 0.01), gen=(0.0, 0.04)), GROUPS,
                           FitRule(floor_cap=1.0), {})
    assert per_group.provenance["floor_signal"] == "per-group" and per_group.floors[0][C.QUERY] == 0.0


def test_floor_cap_under_joint_floors_drops_the_least_sensitive_group_first():
    recs = with_joint(two_cases(), {"query": 0.3, "template": 0.3})
    # single-group: template hurts more in group 1 than in group 0
    for r in recs:
        for cell in r["cells"]:
            if cell["class"] == "template":
                cell["dnll"] = 0.05 if cell["group"] == 1 else 0.001
    shares = class_shares(recs)
    full = fit_policy(recs, GROUPS, FitRule(floor_cap=1.0), {})
    capped = fit_policy(recs, GROUPS, FitRule(floor_cap=floor_mass(full.floors, GROUPS, shares) - 0.01), {})
    first = capped.provenance["floor_cap_demotions"][0]
    assert (first["group"], first["class"]) == (0, "template")


def test_weights_are_distortion_normalised_to_the_largest():
    pol = fit_policy(two_cases(), GROUPS, FitRule(floor_cap=1.0, min_weight=0.02), {})
    assert pol.weights[0][C.GEN_STRUCT] == pytest.approx(1.0)
    assert pol.weights[0][C.QUERY] == pytest.approx(0.5)
    assert pol.weights[0][C.TOOL_NAME] == pytest.approx(0.25)
    assert pol.weights[0][C.TEMPLATE] == pytest.approx(0.05)
    assert pol.weights[0][C.DESCRIPTION] == pytest.approx(0.025)  # above min_weight: kept
    pol2 = fit_policy(two_cases(desc=(0.0, 0.0004)), GROUPS, FitRule(floor_cap=1.0, min_weight=0.02), {})
    assert pol2.weights[1][C.DESCRIPTION] == pytest.approx(0.02)   # 0.01 clamped up to min_weight
    assert pol2.weights[1][C.EXAMPLE] == pytest.approx(0.02)       # never measured: min_weight


def test_floor_cap_demotes_the_least_valuable_protection_first():
    recs = two_cases(tmpl=(0.11, 0.002))      # template: just above tau_hi but a big class
    shares = class_shares(recs)
    full = fit_policy(recs, GROUPS, FitRule(floor_cap=1.0), {})
    assert full.floors[0][C.TEMPLATE] == 1.0
    cap = floor_mass(full.floors, GROUPS, shares) - 0.05
    capped = fit_policy(recs, GROUPS, FitRule(floor_cap=cap), {})
    assert floor_mass(capped.floors, GROUPS, shares) <= cap + 1e-12
    assert capped.provenance["floor_cap_demotions"][0]["class"] == "template"
    assert capped.floors[0][C.QUERY] == 1.0 and capped.floors[1][C.QUERY] == 1.0
    # a cap below the sinks' own share leaves nothing floored but the sinks
    tiny = fit_policy(recs, GROUPS, FitRule(floor_cap=1e-6), {})
    assert all(tiny.floors[g][c] == 0.0 for g in (0, 1) for c in C if c is not C.SINK and not c.is_generated)
    assert tiny.floors[0][C.GEN_STRUCT] == 1.0  # generated classes are kept first by the engine: not capped


def test_fitted_policy_roundtrips_and_compiles():
    pol = fit_policy(two_cases(), GROUPS, FitRule(), {"model_sha256": "abc", "split": "calib", "n_cases": 2})
    again = Policy.from_json(pol.to_json())
    assert again.floors == pol.floors and again.weights == pol.weights and again.kind == "calibrated"
    prov = again.provenance
    assert prov["split"] == "calib" and prov["fit_rule"]["tau_hi"] == 0.10
    assert {m["class"] for m in prov["measurements"]} == {"query", "description", "tool_name", "gen_struct", "template"}
    counts = {C(k): v for k, v in COUNTS.items()}
    comp = compile_policy(pol, 0.33, counts)
    assert comp.effective_budget == pytest.approx(0.33, abs=1e-6)


def test_summarise_statistics():
    cells = summarise(two_cases(), 2)
    q = cells[(0, C.QUERY)]
    assert q.dnll == pytest.approx(0.30) and q.n_cases == 2
    assert q.dnll_sem == pytest.approx(0.01)          # values 0.31, 0.29
    assert q.distortion == pytest.approx(0.02)


def test_bad_rules_raise():
    for rule in (FitRule(tau_lo=0.2, tau_hi=0.1), FitRule(floor_cap=0.0), FitRule(floor_lo=0.7, floor_hi=0.5)):
        with pytest.raises(FitError):
            rule.check()
    with pytest.raises(FitError):
        fit_policy([], GROUPS, FitRule(), {})


# ------------------------------------------------------------------ mapping by relative depth

def calibrated(n_layer: int, arch: str = "gemma3", name: str = "p.json") -> Policy:
    groups = contiguous_groups(n_layer, 4)
    floors = [{c: 0.0 for c in C} for _ in groups]
    weights = [{c: 0.1 * (g + 1) for c in C} for g in range(len(groups))]
    for g in range(len(groups)):
        floors[g][C.QUERY] = 1.0 if g >= 2 else 0.5
    return Policy(groups=groups, floors=floors, weights=weights, kind="calibrated",
                  provenance={"arch": arch, "model_sha256": "s" + name, "file": name})


