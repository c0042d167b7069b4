"""Policy file validation and the budget compile step (floors first, then water-filling by weight)."""

from __future__ import annotations

import json

import pytest

from pask_local.classes import StructuralClass as C
from pask_local.policy import Policy, PolicyError, compile_policy, contiguous_groups
from pask_local.policy.handwritten import handwritten_policy


def _policy(floors: dict, weights: dict, n_layer: int = 8, n_groups: int = 2) -> Policy:
    groups = contiguous_groups(n_layer, n_groups)
    return Policy(groups=groups,
                  floors=[{c: floors.get((g, c), 0.0) for c in C} for g in range(n_groups)],
                  weights=[{c: weights.get((g, c), 0.0) for c in C} for g in range(n_groups)])


COUNTS = {C.SINK: 2, C.QUERY: 20, C.DESCRIPTION: 100, C.SCHEMA_PUNCT: 60, C.TOOL_NAME: 8, C.PARAM_NAME: 10}


def test_contiguous_groups_partition():
    groups = contiguous_groups(18, 4)
    sizes = [len(g) for g in groups]
    assert len(sizes) == 4 and max(sizes) - min(sizes) <= 1
    assert sorted(i for g in groups for i in g) == list(range(18))
    assert all(b[0] == a[-1] + 1 for a, b in zip(groups, groups[1:], strict=False))


def test_floors_are_granted_and_budget_is_met():
    pol = _policy({(0, C.QUERY): 1.0, (1, C.QUERY): 0.5, (0, C.TOOL_NAME): 1.0, (1, C.TOOL_NAME): 1.0},
                  {(g, c): 1.0 for g in range(2) for c in (C.DESCRIPTION, C.SCHEMA_PUNCT, C.PARAM_NAME)})
    out = compile_policy(pol, 0.33, COUNTS)
    assert not out.warnings
    assert out.keep[0][C.QUERY] == 1.0 and out.keep[1][C.QUERY] >= 0.5
    assert out.keep[0][C.SINK] == 1.0  # never_evict
    assert out.granted_entries == pytest.approx(0.33 * out.full_entries, rel=1e-6)
    assert out.effective_budget == pytest.approx(0.33, rel=1e-6)


def test_residual_is_proportional_to_weight():
    pol = _policy({}, {(0, C.DESCRIPTION): 1.0, (0, C.SCHEMA_PUNCT): 3.0,
                       (1, C.DESCRIPTION): 1.0, (1, C.SCHEMA_PUNCT): 3.0})
    out = compile_policy(pol, 0.2, COUNTS)
    d, p = out.keep[0][C.DESCRIPTION], out.keep[0][C.SCHEMA_PUNCT]
    assert 0 < d < 1 and 0 < p < 1
    assert p / d == pytest.approx(3.0, rel=1e-4)
    assert out.keep[0][C.QUERY] == 0.0  # no floor, no weight, budget used up by weighted cells


def test_saturated_cells_cap_at_one_and_the_rest_spreads():
    pol = _policy({}, {(0, C.DESCRIPTION): 1.0, (0, C.SCHEMA_PUNCT): 100.0,
                       (1, C.DESCRIPTION): 1.0, (1, C.SCHEMA_PUNCT): 100.0})
    out = compile_policy(pol, 0.5, COUNTS)
    assert out.keep[0][C.SCHEMA_PUNCT] == pytest.approx(1.0)
    assert out.granted_entries == pytest.approx(0.5 * out.full_entries, rel=1e-6)


def test_unused_capacity_goes_to_unweighted_cells():
    pol = _policy({}, {(0, C.TOOL_NAME): 1.0, (1, C.TOOL_NAME): 1.0})
    out = compile_policy(pol, 0.6, COUNTS)
    assert out.keep[0][C.TOOL_NAME] == 1.0
    assert out.granted_entries == pytest.approx(0.6 * out.full_entries, rel=1e-6)


def test_infeasible_floors_give_way_to_the_budget_least_protective_first():
    """Floors above the budget: the budget holds (it is what the user asked for); the description's
    floor (less protective) goes before the query's, and the warning names what was lowered."""
    pol = _policy({(g, c): 1.0 for g in range(2) for c in (C.DESCRIPTION, C.QUERY)}, {})
    out = compile_policy(pol, 0.2, COUNTS)
    assert out.warnings and "lowered the floors of description" in out.warnings[0]
    assert out.effective_budget == pytest.approx(0.2, abs=1e-6)
    assert out.granted_entries <= 0.2 * out.full_entries + 1e-6
    for g in range(2):
        assert out.keep[g][C.QUERY] >= out.keep[g][C.DESCRIPTION]
    q_share = COUNTS[C.QUERY] / sum(COUNTS.values())
    if q_share <= 0.2:  # the query alone fits: it keeps its whole floor
        assert out.keep[0][C.QUERY] == 1.0 and "query" not in out.warnings[0]


def test_sliding_window_layers_count_their_window():
    pol = _policy({}, {(g, C.DESCRIPTION): 1.0 for g in range(2)}, n_layer=4, n_groups=2)
    n = sum(COUNTS.values())
    out = compile_policy(pol, 1.0, COUNTS, swa_layers=[0, 1], window=50)
    assert out.full_entries == pytest.approx(n * 2 + 50 * 2)
    assert out.layer_capacity[0] <= 50 and out.layer_capacity[3] == n


def test_budget_bounds():
    pol = handwritten_policy(8)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            compile_policy(pol, bad, COUNTS)


def test_layer_capacities_follow_keep_fractions():
    pol = handwritten_policy(8, 2)
    out = compile_policy(pol, 0.33, COUNTS)
    for g, layers in enumerate(pol.groups):
        expect = sum(out.keep[g][c] * k for c, k in COUNTS.items())
        for il in layers:
            assert out.layer_capacity[il] == pytest.approx(expect, abs=1)


def test_roundtrip_and_validation(tmp_path):
    pol = handwritten_policy(18)
    path = tmp_path / "p.json"
    pol.save(path)
    back = Policy.load(path)
    assert back.groups == pol.groups and back.floors == pol.floors and back.kind == "hand-written"
    back.check_model(18)
    with pytest.raises(PolicyError, match="18 layers but the model has 26"):
        back.check_model(26)
    data = json.loads(path.read_text())
    data["floors"][0]["query"] = 1.5
    path.write_text(json.dumps(data))
    with pytest.raises(PolicyError, match=r"floors\[0\]\[query\]"):
        Policy.load(path)
    data["floors"][0] = {"not_a_class": 0.1}
    path.write_text(json.dumps(data))
    with pytest.raises(PolicyError, match="unknown structural class"):
        Policy.load(path)
    data = pol.to_json()
    data["groups"] = [[0, 1], [1, 2]]
    with pytest.raises(PolicyError, match="partition"):
        Policy.from_json(data)
    path.write_text("{not json")
    with pytest.raises(PolicyError, match="invalid JSON"):
        Policy.load(path)
    with pytest.raises(PolicyError, match="not found"):
        Policy.load(tmp_path / "missing.json")


def test_residual_roundtrip_and_validation():
    """``residual`` (pask-hybrid's allocation) survives a save/load; a bad value or one without the
    attention order is refused in one line; files without the field read as ``weights``."""
    from pask_local.policy.handwritten import hybrid_policy

    pol = hybrid_policy(18)
    back = Policy.from_json(pol.to_json())
    assert (back.residual, back.within_class_order) == ("attention", "attention") and back.floors == pol.floors
    data = handwritten_policy(18).to_json()
    del data["residual"]
    assert Policy.from_json(data).residual == "weights"
    for bad, needle in (({"residual": "magic"}, "residual must be one of"),
                        ({"residual": "attention", "within_class_order": "span-head"}, "needs within_class_order")):
        with pytest.raises(PolicyError, match=needle):
            Policy.from_json({**data, **bad})


# ------------------------------------------------------------------ group budget curves
def _curves(*per_group, levels=(0.05, 0.1, 0.2, 0.35, 0.5)):
    from pask_local.policy.groups import GroupCurves

    return GroupCurves(tuple(levels), tuple(tuple(c) for c in per_group))


def test_group_keep_meets_the_budget_and_favours_the_sensitive_group():
    from pask_local.policy.groups import group_keep

    flat = [0.01, 0.01, 0.0, 0.0, 0.0]          # a group that barely notices compression
    steep = [2.0, 1.5, 0.8, 0.3, 0.1]          # one that needs its prompt
    for budget in (0.1, 0.2, 0.33):
        k = group_keep(_curves(flat, flat, steep, steep), budget, [7, 7, 7, 7])
        assert sum(7 * x for x in k) == pytest.approx(budget * 28, rel=1e-6)
        # (shares on one linear piece of a curve tie: which of the steep groups gets more is not pinned)
        assert max(k[0], k[1]) < min(k[2], k[3]), (budget, k)
        assert min(k) >= 0.05 - 1e-9
    # equal curves: equal shares, the budget itself
    k = group_keep(_curves(steep, steep, steep, steep), 0.2, [7, 7, 7, 7])
    assert k == pytest.approx([0.2] * 4, abs=0.011)
    # a budget below every measured level, or all of it: every group gets it
    assert group_keep(_curves(flat, steep), 0.03, [4, 4]) == [0.03, 0.03]
    assert group_keep(_curves(flat, steep), 1.0, [4, 4]) == [1.0, 1.0]


def test_group_keep_never_gives_a_group_less_than_its_minimum_share():
    import dataclasses

    from pask_local.policy.groups import group_keep

    flat = [0.0, 0.0, 0.0, 0.0, 0.0]
    steep = [2.0, 1.5, 0.8, 0.3, 0.1]
    free = group_keep(_curves(flat, flat, steep, steep), 0.2, [7, 7, 7, 7])
    assert free[0] == pytest.approx(0.05)  # unconstrained, the insensitive groups drop to the lowest level
    for m in (0.5, 0.75):
        k = group_keep(dataclasses.replace(_curves(flat, flat, steep, steep), min_share=m), 0.2, [7, 7, 7, 7])
        assert min(k) >= m * 0.2 - 1e-9, (m, k)
        assert sum(7 * x for x in k) == pytest.approx(0.2 * 28, rel=1e-6)
        assert max(k[0], k[1]) < min(k[2], k[3])
    # a minimum share of 1: every group keeps the budget itself
    one = dataclasses.replace(_curves(flat, steep), min_share=1.0)
    assert group_keep(one, 0.2, [4, 4]) == [0.2, 0.2]


def test_group_min_share_round_trips_and_bad_values_are_refused(tmp_path):
    import dataclasses

    pol = _policy({}, {(g, C.DESCRIPTION): 1.0 for g in range(2)})
    pol.group_budget = dataclasses.replace(_curves([0.1] * 5, [0.2] * 5), min_share=0.5)
    pol.save(tmp_path / "p.json")
    assert Policy.load(tmp_path / "p.json").group_budget.min_share == 0.5
    data = json.loads((tmp_path / "p.json").read_text())
    for bad in (-0.1, 1.5, "half", None):
        data["group_budget"]["min_share"] = bad
        (tmp_path / "bad.json").write_text(json.dumps(data))
        with pytest.raises(PolicyError, match="min_share"):
            Policy.load(tmp_path / "bad.json")


def test_group_curves_are_interpolated_and_never_rise():
    c = _curves([0.5, 0.6, 0.2, 0.25, 0.0])  # two measured rises: noise, flattened
    assert c.error(0, 0.01) == 0.5 and c.error(0, 0.1) == 0.5
    assert c.error(0, 0.3) <= c.error(0, 0.2) == pytest.approx(0.2)
    assert c.error(0, 0.75) == pytest.approx(0.0) and c.error(0, 1.0) == 0.0
    assert c.error(0, 0.15) == pytest.approx(0.35)


def test_compile_splits_the_budget_by_the_group_curves():
    pol = _policy({(g, C.QUERY): 1.0 for g in range(2)},
                  {(g, c): 1.0 for g in range(2) for c in (C.DESCRIPTION, C.SCHEMA_PUNCT, C.PARAM_NAME)})
    uniform = compile_policy(pol, 0.33, COUNTS)
    assert uniform.layer_capacity[0] == uniform.layer_capacity[-1]
    pol.group_budget = _curves([0.01, 0.01, 0.0, 0.0, 0.0], [2.0, 1.5, 0.8, 0.3, 0.1])
    out = compile_policy(pol, 0.33, COUNTS)
    assert out.layer_capacity[0] < uniform.layer_capacity[0] < out.layer_capacity[-1]
    assert out.granted_entries == pytest.approx(0.33 * out.full_entries, rel=0.02)
    # a group whose share is below its floors lowers them, and says so for that group only
    low = compile_policy(pol, 0.1, COUNTS)
    assert low.warnings and all("group 0" in w for w in low.warnings)


def test_group_budget_round_trips_and_bad_curves_are_one_line_errors(tmp_path):
    pol = handwritten_policy(8, 2)
    pol.group_budget = _curves([0.1, 0.1, 0.0, 0.0, 0.0], [1.0, 0.5, 0.2, 0.1, 0.0])
    path = tmp_path / "p.json"
    pol.save(path)
    assert Policy.load(path).group_budget == pol.group_budget
    data = json.loads(path.read_text())
    for bad in ({"levels": [0.2, 0.1], "dnll": [[0, 0], [0, 0]]}, {"levels": [0.1], "dnll": [[0.0]]},
                {"levels": [0.1, 1.5], "dnll": [[0, 0], [0, 0]]}, {"levels": [0.1], "dnll": [["x"], [0]]},
                {"levels": [0.1], "dnll": [[float("nan")], [0]]}, [1, 2]):
        path.write_text(json.dumps({**data, "group_budget": bad}))
        with pytest.raises(PolicyError, match="group_budget") as err:
            Policy.load(path)
        assert "\n" not in str(err.value)
