"""The native persistence step (patch 0006) against the Python reference rules (``Method.select``).

Oracle: each method's Python ``select``, written and tested before the native step existed. The
native selection must keep the same positions on random views (every method, every PASK order);
the engine on the real Gemma 270M must make the same evictions, step by step, with the native step
as with the Python rules (one process: no cross-machine output is pinned); hysteresis must hold the
budget and evict in batches; bad input to the C API is an error, never an abort.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
from conftest import REPO, evictions
from hypothesis import given, settings
from hypothesis import strategies as st

from pask_local.classes import StructuralClass
from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.errors import NativeError
from pask_local.llm import ContextConfig, Model
from pask_local.methods import H2O, PASK, TOVA, LayerView, PyramidKV, SnapKV, StreamingLLM
from pask_local.methods.base import StepRule
from pask_local.methods.pask import PASKPlan, relevance_priority
from pask_local.methods.scored import KNorm, KVzipStyle, SnapKVPrefix
from pask_local.native_step import LayerRule, NativeStep, select
from pask_local.policy.handwritten import handwritten_policy, hybrid_policy
from pask_local.schema.tools import read_tools

N_CLASSES = len(StructuralClass)
ORDERS = ["oldest-first", "newest-first", "span-head", "attention"]


def pask_method(order: str, budget: float, all_classes: np.ndarray, n_layer: int = 4, recent: int = 32,
                hold_tail: bool = True) -> PASKPlan:
    """PASK with ``order``, bound to a prompt of ``all_classes`` (the plan selects)."""
    pol = dataclasses.replace(handwritten_policy(n_layer), within_class_order=order)
    return PASK(pol, recent=recent, hold_tail=hold_tail).bind(budget, all_classes, n_layer)


@st.composite
def views(draw):
    n_all = draw(st.integers(min_value=2, max_value=160))
    # few distinct classes make long same-class runs (span-head) and many ties inside a class
    palette = draw(st.lists(st.integers(0, N_CLASSES - 1), min_size=1, max_size=6))
    all_classes = np.array(draw(st.lists(st.sampled_from(palette), min_size=n_all, max_size=n_all)), dtype=np.int64)
    held = draw(st.lists(st.integers(0, n_all - 1), min_size=1, max_size=n_all, unique=True))
    pos = np.array(held, dtype=np.int64)  # any order, as cells hold them
    # continuous scores (Hypothesis' own floats shrink to runs of equal values, where a rule that
    # protects the wrong positions keeps the same set), sometimes rounded so that ties occur too
    scores = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).random(len(pos)) * 4
    if draw(st.booleans()):
        scores = np.round(scores, 1)
    capacity = draw(st.integers(min_value=0, max_value=len(pos) + 2))
    prompt_len = draw(st.integers(min_value=0, max_value=n_all))
    layer = draw(st.integers(0, 3))
    return all_classes, pos, scores, capacity, prompt_len, layer


def both(method, view: LayerView, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    ref = np.sort(method.select(view, capacity))
    rule = method.step_rule(view.layer, view.n_layer, view.prompt_len)
    nat = select(rule, view.positions, view.classes, view.scores, view.all_classes, view.prompt_len, capacity)
    return ref, nat


@pytest.mark.parametrize("name", ["h2o", "tova", "snapkv", "pyramidkv", "streaming"])
@settings(max_examples=150, deadline=None)
@given(v=views())
def test_native_select_equals_python_baselines(v, name):
    all_classes, pos, scores, capacity, prompt_len, layer = v
    method = {"h2o": H2O(), "tova": TOVA(), "snapkv": SnapKV(), "pyramidkv": PyramidKV(),
              "streaming": StreamingLLM()}[name]
    view = LayerView(layer=layer, n_layer=4, positions=pos, classes=all_classes[pos], scores=scores,
                     prompt_len=prompt_len, all_classes=all_classes)
    ref, nat = both(method, view, capacity)
    assert nat.tolist() == ref.tolist()


@pytest.mark.parametrize("name", ["kvzip", "knorm", "snapkv-prefix"])
@settings(max_examples=150, deadline=None)
@given(v=views(), seed=st.integers(0, 2**32 - 1), scored=st.booleans(), pooled=st.booleans())
def test_native_select_equals_python_scored_methods(v, name, seed, scored, pooled):
    """A scored method's plan (its scoring pass's per-layer scores, set once; sinks and the tail from
    ``obs_start`` protected; pooled or not) as a native ``topk`` rule keeps what its ``select`` keeps."""
    all_classes, pos, _, capacity, prompt_len, layer = v
    method = {"kvzip": KVzipStyle(), "knorm": KNorm(), "snapkv-prefix": SnapKVPrefix()}[name]
    rng = np.random.default_rng(seed)
    per_layer = [np.round(rng.random(prompt_len) * 4, int(rng.integers(1, 4))) for _ in range(4)] if scored else None
    plan = method.bind(0.5, all_classes, 4, scores=per_layer, pooled=pooled)
    view = LayerView(layer=layer, n_layer=4, positions=pos, classes=all_classes[pos], prompt_len=prompt_len,
                     all_classes=all_classes)
    ref = np.sort(plan.select(view, capacity))
    raw = None if per_layer is None else np.array([per_layer[layer][p] if p < prompt_len else 0.0 for p in pos])
    nat = select(plan.step_rule(layer, 4, prompt_len), pos, all_classes[pos], raw, all_classes, prompt_len, capacity)
    assert nat.tolist() == ref.tolist()


@pytest.mark.parametrize("order", ORDERS)
@settings(max_examples=200, deadline=None)
@given(v=views(), budget=st.floats(0.05, 1.0), recent=st.sampled_from([0, 4, 32]), hold_tail=st.booleans())
def test_native_select_equals_python_pask(v, order, budget, recent, hold_tail):
    all_classes, pos, scores, capacity, prompt_len, layer = v
    method = pask_method(order, budget, all_classes, recent=recent, hold_tail=hold_tail)
    view = LayerView(layer=layer, n_layer=4, positions=pos, classes=all_classes[pos],
                     scores=scores if order == "attention" else None, prompt_len=prompt_len,
                     all_classes=all_classes)
    ref, nat = both(method, view, capacity)
    assert nat.tolist() == ref.tolist()


@settings(max_examples=200, deadline=None)
@given(v=views(), budget=st.floats(0.05, 1.0), recent=st.sampled_from([0, 4, 32]), hold_tail=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_native_select_equals_python_pask_tool_relevance(v, budget, recent, hold_tail, seed):
    """The tool-relevance order: prompt positions by the priorities uploaded once (few distinct tool
    relevances, so that ties between tools fall to span-head), generated positions span-head."""
    all_classes, pos, _, capacity, prompt_len, layer = v
    method = pask_method("tool-relevance", budget, all_classes, recent=recent, hold_tail=hold_tail)
    relevance = np.random.default_rng(seed).choice([0.0, 0.25, 0.5, 1.0], size=prompt_len)
    method = dataclasses.replace(method, priority=relevance_priority(relevance, all_classes[:prompt_len]))  # as bind sets it
    view = LayerView(layer=layer, n_layer=4, positions=pos, classes=all_classes[pos], prompt_len=prompt_len,
                     all_classes=all_classes)
    ref = np.sort(method.select(view, capacity))
    rule = method.step_rule(layer, 4, prompt_len)
    prio = method.priority[np.minimum(pos, max(0, prompt_len - 1))] if prompt_len else np.zeros(len(pos))
    nat = select(rule, pos, view.classes, prio, all_classes, prompt_len, capacity)
    assert nat.tolist() == ref.tolist()


@settings(max_examples=200, deadline=None)
@given(v=views(), budget=st.floats(0.05, 1.0), recent=st.sampled_from([0, 4, 32]),
       floored=st.sets(st.sampled_from(list(StructuralClass)), max_size=8))
def test_native_select_equals_python_pask_hybrid(v, budget, recent, floored):
    """pask-hybrid (floors as the only quotas, one shared rank for the rest, attention order)."""
    all_classes, pos, scores, capacity, prompt_len, layer = v
    pol = hybrid_policy(4)
    pol.floors = [{c: (1.0 if c in floored else 0.0) for c in StructuralClass} for _ in pol.groups]
    method = PASK(pol, recent=recent).bind(budget, all_classes, 4)
    view = LayerView(layer=layer, n_layer=4, positions=pos, classes=all_classes[pos], scores=scores,
                     prompt_len=prompt_len, all_classes=all_classes)
    ref, nat = both(method, view, capacity)
    assert nat.tolist() == ref.tolist()


def test_native_select_equals_python_pask_with_a_held_tail():
    """Prompts that end in a template run (the assistant's header) with tokens generated after them:
    native == Python for every order, and the held tail decides the keep set often enough that a
    native rule ignoring it (``protect_from`` -1) disagrees (the random views above rarely reach it)."""
    rng = np.random.default_rng(0)
    cls_of = {c: list(StructuralClass).index(c) for c in StructuralClass}
    prompt_mix = [cls_of[c] for c in (StructuralClass.DESCRIPTION, StructuralClass.TEMPLATE,
                                      StructuralClass.QUERY, StructuralClass.PARAM_TYPE)]
    n_views, tail_off_differs = 0, 0
    for _ in range(100):
        n_prompt, n_gen = int(rng.integers(20, 80)), int(rng.integers(0, 30))
        prompt = rng.choice(prompt_mix, size=n_prompt)
        prompt[n_prompt - int(rng.integers(1, 8)):] = cls_of[StructuralClass.TEMPLATE]
        all_classes = np.concatenate([prompt, np.full(n_gen, cls_of[StructuralClass.GEN_STRUCT])]).astype(np.int64)
        pos = rng.permutation(len(all_classes))
        capacity = int(rng.integers(1, len(all_classes)))
        for order in ORDERS[:3]:
            method = pask_method(order, 0.3, all_classes[:n_prompt], recent=4)
            view = LayerView(layer=0, n_layer=4, positions=pos, classes=all_classes[pos], prompt_len=n_prompt,
                             all_classes=all_classes)
            ref, nat = both(method, view, capacity)
            assert nat.tolist() == ref.tolist()
            off = dataclasses.replace(method.step_rule(0, 4, n_prompt), protect_from=-1)
            tail_off_differs += select(off, pos, all_classes[pos], None, all_classes, n_prompt,
                                       capacity).tolist() != ref.tolist()
            n_views += 1
    assert tail_off_differs > n_views // 10


def test_native_select_can_disagree_with_a_wrong_rule():
    """The oracle test has teeth: a rule that differs from the method's (newest vs oldest first) is caught."""
    all_classes = np.array([0] + [6] * 40, dtype=np.int64)  # sink + one long description span
    pos = np.arange(41)
    m = pask_method("oldest-first", 0.3, all_classes, recent=0)
    view = LayerView(layer=0, n_layer=4, positions=pos, classes=all_classes[pos], prompt_len=41,
                     all_classes=all_classes)
    ref = np.sort(m.select(view, 12))
    wrong = dataclasses.replace(m.step_rule(0, 4, 41), order="newest-first")
    nat = select(wrong, pos, all_classes[pos], None, all_classes, 41, 12)
    assert nat.tolist() != ref.tolist()


# ------------------------------------------------------------------ the engine, native vs reference
EXAMPLE = ("get_weather.json", "What is the weather like in Paris today? Answer in celsius.")


@pytest.fixture(scope="module")
def model(gemma_model) -> Model:
    return gemma_model


def run(model, method, budget, tmp_path, tag, **cfg):
    tools = read_tools(REPO / "examples" / EXAMPLE[0])
    engine = Engine(model, make_method(method, model), EngineConfig(budget=budget, max_tokens=48, **cfg))
    trace = tmp_path / f"{method}-{tag}.jsonl"
    return engine.run(tools, EXAMPLE[1], trace=trace), trace


@pytest.mark.slow
@pytest.mark.parametrize("method", ["pask", "pask-attn", "pask-hybrid", "h2o", "tova", "snapkv", "pyramidkv",
                                    "streaming", "kvzip", "knorm"])
def test_engine_native_step_equals_python_reference(model, method, tmp_path):
    ref, ref_trace = run(model, method, 0.33, tmp_path, "ref", native_step=False)
    # hysteresis 0 and no compaction: the native step then evicts, and lays out cells, as the reference
    nat, nat_trace = run(model, method, 0.33, tmp_path, "nat", native_step=True, hysteresis=0.0, compact=False)
    ev_ref, ev_nat = evictions(ref_trace), evictions(nat_trace)
    assert any(k[0] >= 0 for k in ev_ref), "the reference run never evicted while decoding: the check is empty"
    assert ev_nat == ev_ref
    assert nat.tokens == ref.tokens
    assert nat.stats["held_per_group"] == ref.stats["held_per_group"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["h2o", "tova", "snapkv", "pask-attn"])
def test_engine_graph_statistics_evict_as_the_callback_reference(model, method, tmp_path):
    """The statistics computed in the decode graph (patch 0007) lead every score method to the same
    evictions and tokens as the eval-callback probe reading upstream's softmax (the reference)."""
    ref, ref_trace = run(model, method, 0.33, tmp_path, "callback", graph_stats=False)
    got, got_trace = run(model, method, 0.33, tmp_path, "graph")
    assert got.stats["graph_stats"] and not ref.stats["graph_stats"]
    ev_ref, ev_got = evictions(ref_trace), evictions(got_trace)
    assert any(k[2] == "score" for k in ev_ref), "no score-ranked eviction: the check is empty"
    assert ev_got == ev_ref
    assert got.tokens == ref.tokens


@pytest.mark.slow
@pytest.mark.parametrize("method", ["pask", "h2o"])
def test_hysteresis_holds_the_budget_and_evicts_in_batches(model, method, tmp_path):
    plain, plain_trace = run(model, method, 0.33, tmp_path, "h0", hysteresis=0.0)
    batched, batched_trace = run(model, method, 0.33, tmp_path, "h10", hysteresis=0.1)
    assert batched.stats["max_over_budget_entries"] <= 0
    assert batched.ok, batched.error
    decode = {key: v for key, v in evictions(batched_trace).items() if key[0] >= 0 and key[2] != "window"}
    assert decode, "no decode-time eviction to check"
    # each over-target layer goes from target + 1 down to target - 0.1 x its capacity: several at once
    assert all(len(v) >= 2 for v in decode.values())
    assert all(len(v) == 1 for key, v in evictions(plain_trace).items() if key[0] >= 0 and key[2] != "window")
    n_plain = sum(1 for key in evictions(plain_trace) if key[0] >= 0 and key[2] != "window")
    assert len(decode) * 4 < n_plain


# ------------------------------------------------------------------ the C API refuses bad input
def test_step_refuses_a_plain_context(model):
    from pask_local.llm import Context

    ctx = Context(model, ContextConfig(n_ctx=64))
    rules = [LayerRule(StepRule("sink_recent", n_sink=4), cap=8, ratio=0.3)] * model.n_layer
    with pytest.raises(NativeError, match="layered"):
        NativeStep(ctx, rules, [0] * 10, 64, 10)
    ctx.close()


def test_step_refuses_bad_rules_and_positions(model):
    from pask_local.kv_layered import LayeredContext

    ctx = LayeredContext(model, [16] * model.n_layer, ContextConfig(n_ctx=64))
    good = LayerRule(StepRule("sink_recent", n_sink=4), cap=8, ratio=0.3)
    with pytest.raises(NativeError, match="one rule per layer"):
        NativeStep(ctx, [good], [0] * 10, 64, 10)
    for bad in (LayerRule(StepRule("topk", protect_ratio=2.0), cap=8, ratio=0.3),
                LayerRule(StepRule("topk"), cap=8, ratio=0.3, hysteresis=-1)):
        with pytest.raises(NativeError, match="bad rule"):
            NativeStep(ctx, [bad] * model.n_layer, [0] * 10, 64, 10)
    with pytest.raises(NativeError, match="class 99"):
        NativeStep(ctx, [good] * model.n_layer, [0] * 9 + [99], 64, 10)
    step = NativeStep(ctx, [good] * model.n_layer, [0] * 10, 64, 10)
    with pytest.raises(NativeError, match="not the next one"):
        step.token(0, 12, 1)  # position 10 comes next
    with pytest.raises(NativeError, match="no attention probe"):
        step.collect(0)
    with pytest.raises(NativeError, match="out of range"):
        step.evict_to(model.n_layer, 4, 0, "policy")
    with pytest.raises(NativeError, match="out of range"):
        step.set_scores(model.n_layer, [1.0] * 10)
    with pytest.raises(NativeError, match="position 3 is not finite"):
        step.set_scores(0, [1.0, 2.0, 3.0, float("nan")])
    with pytest.raises(NativeError, match="at most max_len"):
        step.set_scores(0, [1.0] * 66)
    step.set_scores(0, [1.0] * 65)  # max_len + 1
    step.close()
    ctx.close()


def test_select_refuses_bad_arrays():
    rule = StepRule("quota", order="attention", keep=(0.5,) * N_CLASSES, rank=tuple(range(N_CLASSES)))
    with pytest.raises(NativeError, match="orders need scores"):
        select(rule, [0, 1], [0, 0], None, [0, 0], 2, 1)
    with pytest.raises(NativeError, match="out of range"):
        select(StepRule("topk"), [-1], [0], [1.0], [0], 1, 0)
    assert ctypes.sizeof(ctypes.c_double) == 8


# ------------------------------------------------------------------ capacities rounded to 256
@pytest.mark.slow
def test_capacities_rounded_to_256_make_budget_one_logits_equal_full(model):
    """With every layer's cells a multiple of 256 (upstream pads n_ctx the same way), the layered cache
    at budget 1.0 computes exactly what upstream's cache computes: identical logits, not just close."""
    from pask_local.kv_layered import LayeredContext
    from pask_local.llm import Context

    tokens = model.tokenize("Readers may borrow up to five books at a time and must return them within three "
                            "weeks; late returns cost ten cents a day, and the reading room closes at six.")
    n_ctx = len(tokens) + 16  # not a multiple of 256: upstream pads it
    cfg = ContextConfig(n_ctx=n_ctx, n_batch=64)
    up = Context(model, cfg)
    lay = LayeredContext(model, [-(-n_ctx // 256) * 256] * model.n_layer, cfg)
    for c in (up, lay):
        assert c.decode(tokens, 0) == 0
    assert np.array_equal(np.asarray(lay.logits()), np.asarray(up.logits()))
    up.close()
    lay.close()


@pytest.mark.slow
def test_engine_capacities_are_aligned_and_the_cost_reported(model, tmp_path):
    res, _ = run(model, "pask", 0.33, tmp_path, "align")
    caps, s = res.stats["capacity_per_layer"], res.stats
    assert all(c % 256 == 0 for c in caps)
    assert 0 < s["kv_bytes_alignment"] < s["kv_bytes_allocated"]
    plain, _ = run(model, "pask", 0.33, tmp_path, "noalign", cell_align=1)
    assert plain.stats["kv_bytes_alignment"] == 0
    assert s["kv_bytes_allocated"] - plain.stats["kv_bytes_allocated"] == s["kv_bytes_alignment"]


@pytest.mark.slow
def test_flash_attention_reaches_the_context_score_methods_included(model, tmp_path):
    on, _ = run(model, "pask", 0.33, tmp_path, "fa", flash_attn=True)
    assert on.stats["flash_attn"] is True and on.ok
    scored, _ = run(model, "h2o", 0.33, tmp_path, "fa-h2o", flash_attn=True)
    # the statistics are computed in the decode graph beside the fused kernel (patch 0007)
    assert scored.stats["flash_attn"] is True and scored.stats["graph_stats"] is True
    assert scored.stats["max_over_budget_entries"] <= 0
    ref, _ = run(model, "h2o", 0.33, tmp_path, "fa-h2o-callback", flash_attn=True, graph_stats=False)
    assert ref.stats["flash_attn"] is False  # the eval-callback reference reads the explicit softmax


# ------------------------------------------------------------------ compaction after a one-time compression
def _logit_gap(up, lay, tokens, n, seqs) -> tuple[float, float]:
    """Decode ``tokens`` from position n in each of ``seqs`` of both contexts: (largest logit gap of
    ``lay`` from ``up``, largest |logit| of ``up``)."""
    worst = scale = 0.0
    for i, t in enumerate(tokens):
        for seq in seqs:
            for c in (up, lay):
                assert c.decode([t], n + i, seq_id=seq) == 0
            ref = np.asarray(up.logits())
            worst = max(worst, float(np.abs(np.asarray(lay.logits()) - ref).max()))
            scale = max(scale, float(np.abs(ref).max()))
    return worst, scale


@pytest.mark.parametrize("fa", [False, True])
def test_compaction_gathers_the_held_cells_and_keeps_attention_as_upstream(tmp_path, fa):
    """After scattered evictions, compaction moves every held cell (and its K/V rows, V transposed
    without flash attention) below the held count; decoding then gives upstream's logits after the
    same ``seq_rm`` (the oracle) up to the order of the attention sums. A synthetic qwen3 model with
    an F32 KV cache, so that order noise is tiny and a misplaced row is not."""
    import sys

    from pask_local.attention import cell_positions
    from pask_local.kv_layered import LayeredContext
    from pask_local.llm import Context

    sys.path.insert(0, str(REPO / "tests"))
    from kv_layered_helpers import random_tokens, synthetic

    model = Model(synthetic(tmp_path, "qwen3"))
    n = 120
    toks = random_tokens(n, model.n_vocab, seed=3)
    cfg = ContextConfig(n_ctx=512, n_batch=128, type_k=0, type_v=0, flash_attn=fa)  # ggml type 0: F32
    up, lay = Context(model, cfg), LayeredContext(model, [512] * model.n_layer, cfg)
    for c in (up, lay):
        assert c.decode(toks, 0) == 0
    evicted = sorted(np.random.default_rng(0).choice(np.arange(4, n - 8), size=60, replace=False).tolist())
    for il in range(model.n_layer):
        lay.evict(il, evicted)
    for p in evicted:
        up.seq_rm(0, p, p + 1)
    held = sorted(set(range(n)) - set(evicted))
    step = NativeStep(lay, [LayerRule(StepRule("sink_recent", n_sink=4), cap=8, ratio=0.3)] * model.n_layer,
                      [0] * n, 512, n)
    assert step.compact() > 0
    for il in range(model.n_layer):
        cells = cell_positions(lay, il)
        assert sorted(cells[cells >= 0].tolist()) == held                        # the same positions ...
        assert (cells[:len(held)] >= 0).all() and (cells[len(held):] < 0).all()  # ... in the lowest cells
    worst, scale = _logit_gap(up, lay, random_tokens(12, model.n_vocab, seed=5), n, (0,))
    # seen here: 4.5e-6 without flash attention (logits up to 7.3), ~1e-2 with it (its F16 accumulation)
    assert worst <= (2e-2 if fa else 1e-4) * scale
    step.close()
    for c in (up, lay):
        c.close()


@pytest.mark.parametrize("fa", [False, True])
def test_compaction_of_one_stream_leaves_the_others_as_upstream(tmp_path, fa):
    """A stream per sequence (the slot pool): compacting sequence 1 moves only its stream's cells and
    rows; both sequences then decode as upstream's two-stream cache after the same ``seq_rm``."""
    import sys

    from pask_local.attention import cell_positions
    from pask_local.kv_layered import LayeredContext
    from pask_local.llm import Context

    sys.path.insert(0, str(REPO / "tests"))
    from kv_layered_helpers import random_tokens, synthetic

    model = Model(synthetic(tmp_path, "qwen3"))
    n = 120
    toks = {0: random_tokens(n, model.n_vocab, seed=7), 1: random_tokens(n, model.n_vocab, seed=3)}
    cfg = ContextConfig(n_ctx=1024, n_batch=128, n_seq_max=2, type_k=0, type_v=0, flash_attn=fa)
    up, lay = Context(model, cfg), LayeredContext(model, [512] * model.n_layer, cfg)
    for c in (up, lay):
        for seq in (0, 1):
            assert c.decode(toks[seq], 0, seq_id=seq) == 0
    rng = np.random.default_rng(0)
    evicted = {seq: sorted(rng.choice(np.arange(4, n - 8), size=60, replace=False).tolist()) for seq in (0, 1)}
    for seq in (0, 1):
        for il in range(model.n_layer):
            lay.evict(il, evicted[seq], seq)
        for p in evicted[seq]:
            up.seq_rm(seq, p, p + 1)
    before0 = [cell_positions(lay, il, 0).copy() for il in range(model.n_layer)]
    step = NativeStep(lay, [LayerRule(StepRule("sink_recent", n_sink=4), cap=8, ratio=0.3)] * model.n_layer,
                      [0] * n, 512, n, seq_id=1)
    assert step.compact() > 0
    held = sorted(set(range(n)) - set(evicted[1]))
    for il in range(model.n_layer):
        cells = cell_positions(lay, il, 1)
        assert (cells[:len(held)] >= 0).all() and (cells[len(held):] < 0).all()
        assert sorted(cells[cells >= 0].tolist()) == held
        np.testing.assert_array_equal(cell_positions(lay, il, 0), before0[il])  # the other stream: untouched
    worst, scale = _logit_gap(up, lay, random_tokens(6, model.n_vocab, seed=5), n, (0, 1))
    assert worst <= (2e-2 if fa else 1e-4) * scale
    step.close()
    for c in (up, lay):
        c.close()


@pytest.mark.slow
def test_engine_compacts_after_a_one_time_compression(model, tmp_path):
    """SnapKV prefills the prompt whole, compresses it once; compaction then lets n_kv shrink."""
    res, _ = run(model, "snapkv", 0.33, tmp_path, "compact")
    assert res.ok and res.stats["max_over_budget_entries"] <= 0
    off, _ = run(model, "snapkv", 0.33, tmp_path, "nocompact", compact=False)
    assert off.ok
