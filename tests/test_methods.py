"""Selection rules of PASK and the baselines, on hand-built layer views (scores given directly)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pask_local.classes import StructuralClass as C
from pask_local.classes import class_index
from pask_local.methods import H2O, PASK, TOVA, FullKV, LayerView, PyramidKV, SnapKV, StreamingLLM
from pask_local.methods.snapkv import pool_scores
from pask_local.policy import Policy, contiguous_groups
from pask_local.policy.schema import PolicyError

RNG = np.random.default_rng(7)


def view(n: int, scores=None, classes=None, layer: int = 0, prompt_len: int | None = None) -> LayerView:
    pos = RNG.permutation(n)  # held positions arrive in arbitrary (cell) order
    cls = np.zeros(n, dtype=np.int64) if classes is None else np.asarray(classes)[pos]
    sc = None if scores is None else np.asarray(scores, dtype=float)[pos]
    return LayerView(layer=layer, n_layer=4, positions=pos, classes=cls, scores=sc,
                     prompt_len=n if prompt_len is None else prompt_len,
                     all_classes=None if classes is None else np.asarray(classes))


def test_full_keeps_everything():
    v = view(50)
    assert FullKV().select(v, 10).tolist() == list(range(50))
    assert FullKV().capacities(0.3, np.zeros(50, dtype=np.int64), 3) == [50, 50, 50]


def test_streaming_keeps_exactly_sinks_and_window():
    kept = StreamingLLM(n_sink=4).select(view(100), 20)
    assert kept.tolist() == [0, 1, 2, 3, *range(84, 100)]


def test_h2o_keeps_heavy_hitters_and_recent():
    scores = np.zeros(100)
    scores[[5, 17, 33, 42, 60]] = [9, 8, 7, 6, 5]
    kept = H2O(recent_ratio=0.5).select(view(100, scores), 10)
    assert set(kept.tolist()) == {5, 17, 33, 42, 60, *range(95, 100)}


def test_snapkv_keeps_window_and_top_pooled_scores():
    n, window, cap = 200, 16, 40
    scores = RNG.random(n)
    v = view(n, scores, prompt_len=n)
    kept = SnapKV(window=window, kernel=5).select(v, cap)
    # independent computation of the expected set
    pooled = np.convolve(np.pad(scores, (2, 2), mode="edge"), np.ones(5) / 5, mode="valid")
    cand = np.arange(n - window)
    top = cand[np.argsort(-pooled[: n - window], kind="stable")[: cap - window]]
    assert set(kept.tolist()) == set(top.tolist()) | set(range(n - window, n))
    assert len(kept) == cap


def test_pool_scores_is_order_independent():
    pos = np.array([3, 0, 2, 1])
    s = np.array([4.0, 1.0, 3.0, 2.0])
    out = pool_scores(pos, s, 3)
    assert out[pos.tolist().index(0)] == pytest.approx((1 + 1 + 2) / 3)
    assert out[pos.tolist().index(2)] == pytest.approx((2 + 3 + 4) / 3)


def test_pyramid_capacities_decrease_and_keep_total():
    caps = PyramidKV().capacities(0.33, np.zeros(1000, dtype=np.int64), 18)
    assert all(a >= b for a, b in zip(caps, caps[1:], strict=False)) and caps[0] > caps[-1]
    assert sum(caps) == pytest.approx(0.33 * 1000 * 18, rel=0.01)
    big = PyramidKV().capacities(0.9, np.zeros(100, dtype=np.int64), 6)
    assert max(big) <= 100 and sum(big) == pytest.approx(0.9 * 600, rel=0.02)


def test_tova_drops_lowest_current_attention_keeps_newest():
    scores = np.linspace(1, 0, 30)
    scores[29] = 0.0  # the newest token itself has low attention but stays
    kept = TOVA().select(view(30, scores), 10)
    assert kept.tolist() == [*range(9), 29]


def _pask_policy(n_layer=4):
    groups = contiguous_groups(n_layer, 2)
    floors = [{c: 0.0 for c in C} for _ in groups]
    weights = [{c: 0.0 for c in C} for _ in groups]
    for g in range(2):
        floors[g][C.QUERY] = 1.0
        weights[g][C.DESCRIPTION] = 1.0
    floors[1][C.DESCRIPTION] = 0.5
    return Policy(groups=groups, floors=floors, weights=weights)


def test_pask_keeps_protected_classes_and_oldest_go_first():
    classes = np.array([class_index(C.SINK)] + [class_index(C.DESCRIPTION)] * 60 + [class_index(C.QUERY)] * 19)
    method = PASK(_pask_policy(), recent=0).bind(0.5, classes, 4)  # the request's plan
    caps = list(method.capacities)  # the floors fit (at 0.4 group 1's description floor gives way)
    assert list(method.warnings) == []
    assert caps[0] == caps[1] and caps[2] == caps[3]
    kept0 = method.select(view(80, classes=classes, layer=0), caps[0])
    assert {0, *range(61, 80)} <= set(kept0.tolist())  # sink + whole query
    desc = sorted(set(kept0.tolist()) & set(range(1, 61)))
    assert desc == list(range(61 - len(desc), 61))  # the newest descriptions survive
    assert len(kept0) == caps[0]
    kept2 = method.select(view(80, classes=classes, layer=2), caps[2])
    assert len(set(kept2.tolist()) & set(range(1, 61))) >= 30  # floor 0.5 in group 1


def test_pask_span_head_keeps_the_start_of_every_span():
    # sink, three 20-token descriptions separated by a tool name each, then a query
    D, T, Q = class_index(C.DESCRIPTION), class_index(C.TOOL_NAME), class_index(C.QUERY)
    classes = np.array([class_index(C.SINK)] + ([T] + [D] * 20) * 3 + [Q] * 16)
    pol = _pask_policy()
    pol.floors = [{**f, C.TOOL_NAME: 1.0} for f in pol.floors]
    pol.within_class_order = "span-head"
    method = PASK(pol, recent=0).bind(0.5, classes, 4)
    caps = list(method.capacities)
    kept = set(method.select(view(len(classes), classes=classes, layer=0), caps[0]).tolist())
    starts = [2, 23, 44]  # first description token of each tool
    n_desc = len(kept & {i for i in range(len(classes)) if classes[i] == D})
    assert 3 <= n_desc < 60
    per_span = [len(kept & set(range(s, s + 20))) for s in starts]
    assert max(per_span) - min(per_span) <= 1  # evictions spread over the spans
    for s, k in zip(starts, per_span, strict=True):
        assert set(range(s, s + k)) <= kept  # each span keeps its head
    oldest = PASK(_pask_policy(), recent=0)  # the default order drops the oldest span first
    oldest.policy.floors = pol.floors
    oldest = oldest.bind(0.5, classes, 4)
    kept_old = set(oldest.select(view(len(classes), classes=classes, layer=0), caps[0]).tolist())
    assert len(kept_old & set(range(2, 22))) < len(kept & set(range(2, 22)))


def test_pask_attention_order_keeps_class_shares_and_ranks_by_score():
    """within_class_order 'attention': each class keeps the share span-head would keep, but the
    members that persist are the highest-scoring (pooled) ones, not the heads of spans."""
    D, T, Q = class_index(C.DESCRIPTION), class_index(C.TOOL_NAME), class_index(C.QUERY)
    classes = np.array([class_index(C.SINK)] + ([T] + [D] * 20) * 3 + [Q] * 16)
    n = len(classes)
    scores = np.full(n, 0.01)
    hot = np.arange(30, 40)          # the middle of the second description
    scores[hot] = 5.0
    pol = _pask_policy()
    pol.floors = [{**f, C.TOOL_NAME: 1.0} for f in pol.floors]
    pol.within_class_order = "attention"
    method = PASK(pol, recent=0)
    assert method.needs_attention and method.compress_after_prefill
    plan = method.bind(0.5, classes, 4)
    caps = list(plan.capacities)
    kept = set(plan.select(view(n, scores=scores, classes=classes, layer=0), caps[0]).tolist())
    head = PASK(_pask_policy(), recent=0)
    head.policy.floors = pol.floors
    head.policy.within_class_order = "span-head"
    assert not head.needs_attention
    head_plan = head.bind(0.5, classes, 4)
    kept_head = set(head_plan.select(view(n, classes=classes, layer=0), caps[0]).tolist())
    for c in (D, T, Q):  # the same number of tokens of every class
        members = {i for i in range(n) if classes[i] == c}
        assert len(kept & members) == len(kept_head & members)
    desc = {i for i in range(n) if classes[i] == D}
    near_hot = set(range(hot[0] - 3, hot[-1] + 4))  # pooling (kernel 7) spreads the scores by 3
    assert kept & desc and (kept & desc) <= near_hot
    assert not (kept_head & desc) <= near_hot
    with pytest.raises(RuntimeError, match="needs attention scores"):
        plan.select(view(n, classes=classes, layer=0), caps[0])


def test_pask_hybrid_keeps_the_floors_whole_and_fills_the_rest_by_attention_across_classes():
    """residual 'attention' (pask-hybrid): floored classes persist whole; the rest of the capacity goes
    to the highest pooled scores whatever their class, so a hot description keeps all its room while
    a cold class gets none (a class quota would have given every class a share)."""
    from pask_local.policy.handwritten import hybrid_policy

    S, D, T, Q, X = (class_index(c) for c in (C.SINK, C.DESCRIPTION, C.TOOL_NAME, C.QUERY, C.EXAMPLE))
    classes = np.array([S] + ([T] * 2 + [D] * 20) * 3 + [X] * 30 + [Q] * 10)
    n = len(classes)
    scores = np.full(n, 0.01)
    hot = np.arange(30, 40)                 # the middle of the second description
    scores[hot] = 5.0
    method = PASK(hybrid_policy(4), recent=0)
    assert method.needs_attention and method.compress_after_prefill
    plan = method.bind(0.3, classes, 4)
    cap = plan.capacities[0]
    kept = set(plan.select(view(n, scores=scores, classes=classes, layer=0), cap).tolist())
    assert len(kept) == cap
    floored = {i for i in range(n) if classes[i] in (S, T, Q)}
    assert floored <= kept
    rest = kept - floored
    near_hot = set(range(hot[0] - 3, hot[-1] + 4))  # pooling (kernel 7) spreads the scores by 3
    assert rest and rest <= near_hot
    assert not kept & {i for i in range(n) if classes[i] == X}  # the cold examples get nothing
    # the same floors as quotas with weights (pask-attn's allocation) give the examples a share
    quota = PASK(dataclasses.replace(hybrid_policy(4), residual="weights"), recent=0).bind(0.3, classes, 4)
    quota_cap = quota.capacities[0]
    kept_quota = set(quota.select(view(n, scores=scores, classes=classes, layer=0), quota_cap).tolist())
    assert kept_quota & {i for i in range(n) if classes[i] == X}
    with pytest.raises(PolicyError, match="within_class_order"):
        dataclasses.replace(_pask_policy(), residual="attention")


def test_pask_rejects_policy_for_other_model():
    with pytest.raises(Exception, match="4 layers but the model has 6"):
        PASK(_pask_policy()).capacities(0.4, np.zeros(10, dtype=np.int64), 6)


def test_protected_window_larger_than_capacity_keeps_newest():
    v = view(100, RNG.random(100), prompt_len=100)
    kept = SnapKV(window=32).select(v, 10)
    assert kept.tolist() == list(range(90, 100))


def test_pask_always_keeps_the_recent_window():
    classes = np.array([class_index(C.SINK)] + [class_index(C.DESCRIPTION)] * 79)
    method = PASK(_pask_policy(), recent=8).bind(0.4, classes, 4)
    caps = method.capacities
    kept = method.select(view(80, classes=classes, layer=0), caps[0])
    assert set(range(72, 80)) <= set(kept.tolist()) and 0 in kept and len(kept) == caps[0]


def test_pask_holds_the_prompt_tail_while_the_call_is_written():
    """The prompt's tail (of its last ``recent`` tokens, the final run of query and template tokens:
    the question and the assistant's header) stays held after more than ``recent`` tokens were
    generated, and a tool definition's end before it does not; without ``hold_tail`` the newest
    window slides onto the call and the tail is evicted with the rest of its class."""
    classes = np.array([class_index(C.SINK)] + [class_index(C.DESCRIPTION)] * 73 + [class_index(C.TEMPLATE)] * 6
                       + [class_index(C.GEN_STRUCT)] * 20)
    kept = {}
    for hold in (True, False):
        # newest-first: within its class the newest goes first, so only a held tail survives
        method = PASK(dataclasses.replace(_pask_policy(), within_class_order="newest-first"), recent=8,
                      hold_tail=hold).bind(0.5, classes[:80], 4)
        caps = method.capacities
        assert method.tail_from(80) == (74 if hold else -1)
        kept[hold] = set(method.select(view(100, classes=classes, layer=2, prompt_len=80), caps[2]).tolist())
        assert set(range(80, 100)) <= kept[hold] and len(kept[hold]) == caps[2]
        assert not {72, 73} & kept[hold]  # the description's end is not part of the tail
    assert set(range(74, 80)) <= kept[True]
    assert not set(range(74, 80)) <= kept[False]
