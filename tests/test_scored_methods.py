"""The query-agnostic methods that can compress a prefix once: floors-only, snapkv-prefix, kvzip,
pask-zip.

Oracles: SnapKV's own whole-prompt path (its observation window read from the last prefill chunk)
on the prefix alone keeps what ``snapkv-prefix``'s scoring pass keeps; the in-graph statistics of
the KVzip-style pass equal the eval-callback probe's (the softmax read from the graph's tensors);
two questions behind the same tools get the same prefix scores; a restored prefix keeps its budget;
pask-zip keeps its policy's floors and then exactly the positions kvzip's own pass scores highest.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import evictions
from serve_helpers import WEATHER_TIME_TOOLS as TOOLS

from pask_local.classes import StructuralClass, class_index
from pask_local.methods.registry import QUERY_AGNOSTIC, REGISTRY
from pask_local.methods.scored import KVzipStyle, SnapKVPrefix, prefix_end
from pask_local.policy.schema import Policy, PolicyError

Q = class_index(StructuralClass.QUERY)
D = class_index(StructuralClass.DESCRIPTION)


def test_new_methods_are_registered_query_agnostic():
    for name in ("floors-only", "snapkv-prefix", "kvzip", "pask-zip", "knorm", "keydiff"):
        assert name in QUERY_AGNOSTIC and not REGISTRY[name].query_aware


def test_scored_plan_keeps_sinks_the_tail_and_the_best_scored():
    classes = np.array([D] * 20 + [Q] * 5)
    assert prefix_end(classes) == 20 and prefix_end(np.array([D] * 7)) == 7
    m = SnapKVPrefix(window=4, kernel=1)
    scores = np.zeros(25)
    scores[[6, 9, 12]] = [3.0, 2.0, 1.0]
    plan = m.bind(0.5, classes, 1, scores=[scores])
    assert plan.obs_start == 16
    from pask_local.methods import LayerView

    view = LayerView(layer=0, n_layer=1, positions=np.arange(25), classes=classes, prompt_len=25,
                     all_classes=classes)
    kept = plan.select(view, 15)
    # 4 sinks + positions 16..24 (window + question) + the two best-scored of the rest
    assert kept.tolist() == [0, 1, 2, 3, 6, 9, *range(16, 25)]
    # without scores the oldest non-sinks go first
    kept = m.bind(0.5, classes, 1).select(view, 15)
    assert kept.tolist() == [0, 1, 2, 3, 14, 15, *range(16, 25)]


def test_floors_residual_needs_the_newest_first_order():
    from pask_local.policy.handwritten import floors_policy

    pol = floors_policy(24)
    assert pol.residual == "recent" and pol.within_class_order == "newest-first"
    with pytest.raises(PolicyError, match="newest-first"):
        Policy(groups=pol.groups, floors=pol.floors, weights=pol.weights, within_class_order="span-head",
               residual="recent")


def test_pask_zip_is_pask_with_kvzips_pass_and_floors():
    """pask-zip declares kvzip's pass (same scorer, same instruction: one memo entry), is planned before
    prefill without a native rule; every other PASK variant declares no pass and keeps its native rule."""
    from pask_local.engine.prescore import READS
    from pask_local.methods import LayerView
    from pask_local.methods.pask import PASK
    from pask_local.policy.handwritten import HYBRID_FLOORS, hybrid_policy

    zip_, kvzip = REGISTRY["pask-zip"], KVzipStyle()
    assert zip_.variant is not None and zip_.variant.order is not None
    pol = dataclasses.replace(hybrid_policy(4), within_class_order="reconstruction", residual="reconstruction")
    m = PASK(pol, recent=0)
    assert (m.prompt_scorer, m.instruction) == (kvzip.prompt_scorer, kvzip.instruction)
    assert [getattr(m, a) for a in READS[m.prompt_scorer]] == [getattr(kvzip, a) for a in READS[m.prompt_scorer]]
    assert not m.native_step and m.prefill_mode == "planned" and not m.order.query_aware
    assert zip_.variant.order is m.order
    for name in ("pask", "pask-prior", "pask-attn", "pask-hybrid", "floors-only", "pask-tools"):
        v = REGISTRY[name].variant
        order = v.order.name if v is not None and v.order is not None else "span-head"
        other = PASK(dataclasses.replace(hybrid_policy(4), within_class_order=order, residual="weights"))
        assert other.prompt_scorer == "" and other.native_step, name
    # a hand-built prompt: 2 sinks, a tool name, descriptions, the query; capacity for 3 more
    S, N = class_index(StructuralClass.SINK), class_index(StructuralClass.TOOL_NAME)
    classes = np.array([S, S, N, N] + [D] * 10 + [Q] * 2)
    scores = np.zeros(16)
    scores[[5, 8, 11, 12]] = [4.0, 3.0, 1.0, 2.0]
    view = LayerView(layer=0, n_layer=4, positions=np.arange(16), classes=classes, prompt_len=16,
                     all_classes=classes)
    plan = m.bind(0.5, classes, 4, scores=[scores] * 4)
    floored = [i for i, c in enumerate(classes) if list(StructuralClass)[c] in HYBRID_FLOORS]
    assert floored == [0, 1, 2, 3, 14, 15]
    assert plan.select(view, 9).tolist() == [0, 1, 2, 3, 5, 8, 12, 14, 15]  # floors, then 4 > 3 > 2 by score
    with pytest.raises(RuntimeError, match="scores"):
        m.bind(0.5, classes, 4).select(view, 9)  # no pass ran: it says so, it does not guess


# ------------------------------------------------------------------ on Qwen 0.5B
def _engine(model, method, budget=0.33, **cfg):
    from pask_local.engine import Engine, EngineConfig

    m = REGISTRY[method].build(model) if isinstance(method, str) else method
    return Engine(model, m, EngineConfig(budget=budget, max_tokens=48, style="native", **cfg))


def _tools():
    from pask_local.schema.tools import load_tools

    return load_tools(TOOLS)


def _prompt(engine, question):
    prepared = engine.prepare([{"role": "user", "content": question}], _tools(), "required")
    p = prepared.plan.prompt
    return prepared, list(p.tokens), np.array([class_index(c) for c in p.classes])


@pytest.mark.slow
def test_snapkv_prefix_keeps_what_snapkv_keeps_of_the_prefix_alone(qwen05_model):
    """Independent oracle: SnapKV's engine path (whole prefill, window from the last chunk)."""
    from pask_local.prefix.build import prefill_prefix

    snap = _engine(qwen05_model, "snapkv")
    ours = SnapKVPrefix()
    ours.name, ours.n_sink = "snapkv-prefix", 0  # SnapKV protects no sinks
    _, _, want, _, _ = prefill_prefix(snap, _tools(), [])
    prefix, _, got, _, _ = prefill_prefix(_engine(qwen05_model, ours), _tools(), [])
    n = len(prefix.tokens)
    overlap = [len(set(a) & set(b)) / len(a) for a, b in zip(want, got, strict=True)]
    assert all(len(a) == len(b) for a, b in zip(want, got, strict=True))
    assert min(overlap) >= 0.97, overlap  # batch shapes differ: float near-ties may flip
    assert max(len(a) for a in got) < 0.4 * n


@pytest.mark.slow
def test_kvzip_scores_in_graph_equal_the_callback_probe_and_ignore_the_question(qwen05_model):
    from pask_local.engine import prescore
    from pask_local.engine.prescore import prompt_scores

    engine = _engine(qwen05_model, "kvzip")
    _, toks, cls = _prompt(engine, "What is the weather in Paris in celsius?")
    _, toks2, cls2 = _prompt(engine, "Time in Tokyo now, please, and quickly?")
    end = prefix_end(cls)
    assert end == prefix_end(cls2) and toks[:end] == toks2[:end] and toks != toks2
    m = engine.method
    graph = prompt_scores(qwen05_model, m, toks, end, engine.cfg)
    assert all(np.array_equal(a, b) for a, b in zip(graph, prompt_scores(qwen05_model, m, toks2, end, engine.cfg),
                                                    strict=True))  # a kept pass
    prescore._MEMO.clear()  # computed again from the other prompt
    other = prompt_scores(qwen05_model, m, toks2, end, engine.cfg)
    callback = prompt_scores(qwen05_model, m, toks, end, dataclasses.replace(engine.cfg, graph_stats=False))
    for il in range(qwen05_model.n_layer):
        assert np.all(graph[il][end:] == 0) and graph[il][:end].sum() > 1.0
        np.testing.assert_array_equal(graph[il][:end], other[il][:end])  # the question is never read
        np.testing.assert_allclose(graph[il], callback[il], rtol=2e-2, atol=1e-3)
    window = prompt_scores(qwen05_model, SnapKVPrefix(), toks, end, engine.cfg)
    # a different statistic: the repetition reads the whole prefix, the window only its tail's view
    assert not np.allclose(window[0][:end] / window[0].sum(), graph[0][:end] / graph[0].sum(), atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["kvzip", "floors-only", "pask-zip"])
def test_compressed_once_then_restored_holds_the_budget(qwen05_model, tmp_path, method):
    """A restored prefix is not scored again, and its kept entries are what the request keeps."""
    from pask_local.prefix.build import compress, open_file, pin, run_from_prefix, save

    engine = _engine(qwen05_model, method)
    path = tmp_path / "p.pkv"
    c = compress(engine, _tools(), [])
    assert c.held <= 0.34 * c.full
    save(path, c)
    header, blob = open_file(path, qwen05_model)
    pinned = pin(path, header, blob, qwen05_model, method, 0.33, "f16", _tools())
    prepared, _, _ = _prompt(engine, "What is the weather in Paris in celsius?")
    res = run_from_prefix(engine, prepared, pinned)
    assert res.stats["prefix_source"] == "prefix"
    assert res.stats["budget_used_after_prefill"] >= 0.30  # the restored entries were kept (unscored: 0.18)
    assert res.stats["max_over_budget_entries"] == 0
    assert res.ok and res.parsed["name"] in {t["function"]["name"] for t in TOOLS}


def _kept_after_prefill(engine, prepared, trace):
    """A real run's result and, per layer, the prompt positions it holds once its prefill is over (its
    trace's prefill evictions taken from the whole prompt)."""
    res = engine.execute(prepared, trace)
    n, n_layer = res.stats["n_prompt"], engine.model.n_layer
    gone = [set() for _ in range(n_layer)]
    for (step, layer, _), pos in evictions(trace).items():
        if step == -1:
            gone[layer] |= pos
    return res, [set(range(n)) - g for g in gone]


@pytest.mark.slow
def test_pask_zip_keeps_the_floors_then_what_kvzips_pass_scores_highest(qwen05_model, tmp_path):
    """Oracle: the policy's floors (and PASK's newest ``recent``) whole, then, per layer, the remaining
    positions ranked by the scores kvzip's own pass gives the same prompt (ranked here, ties newer first).
    The run shares that pass through the memo (one entry after both), and holds the budget."""
    from pask_local.engine import prescore

    engine = _engine(qwen05_model, "pask-zip")
    m, n_layer = engine.method, qwen05_model.n_layer
    prepared, toks, cls = _prompt(engine, "What is the weather in Paris in celsius?")
    n, end = len(toks), prefix_end(cls)
    prescore._MEMO.clear()
    scores = prescore.prompt_scores(qwen05_model, KVzipStyle(), toks, end, engine.cfg)
    res, kept = _kept_after_prefill(engine, prepared, tmp_path / "t.jsonl")
    assert len(prescore._MEMO) == 1  # the run's pass was kvzip's
    assert res.stats["max_over_budget_entries"] <= 0 and res.stats["budget_used_after_prefill"] <= 0.34
    assert res.ok
    pol, pos = m.policy, np.arange(n)
    group_of, caps = pol.group_of_layer(), m.capacities(engine.cfg.budget, cls, n_layer)
    for il in range(n_layer):
        floors = pol.floors[group_of[il]]
        for c, f in floors.items():  # every floor quota held
            members = set(np.flatnonzero(cls == class_index(c)).tolist())
            assert len(members & kept[il]) >= np.ceil(f * len(members) - 1e-9), (il, c)
        assert set(floors.values()) <= {0.0, 1.0}
        whole = [class_index(c) for c, f in floors.items() if f > 0] + [class_index(c) for c in pol.never_evict]
        forced = np.isin(cls, whole) | (pos >= n - m.recent)
        assert len(kept[il]) == caps[il]
        room = caps[il] - int(forced.sum())
        assert room > 10, room
        rest = np.flatnonzero(~forced)
        best = rest[np.lexsort((-rest, -scores[il][rest]))[:room]]  # highest score first; ties newer first
        assert kept[il] == set(pos[forced].tolist()) | set(best.tolist()), il
        # the oracle tells the score apart from a positional residual
        assert set(best.tolist()) != set(rest[:room].tolist()) and set(best.tolist()) != set(rest[-room:].tolist())


@pytest.mark.slow
def test_pask_zip_keeps_the_same_catalog_for_another_question(qwen05_model, tmp_path):
    """Two questions of equal length behind the same catalog: the same catalog positions in every
    layer (the pass never reads the question; the memo is cleared so each prompt is scored anew)."""
    from pask_local.engine import prescore

    engine = _engine(qwen05_model, "pask-zip")
    held = []
    for k, question in enumerate(("What is the weather in Paris in celsius?",
                                  "Time in Tokyo now, please, and quickly?")):
        prescore._MEMO.clear()
        prepared, toks, cls = _prompt(engine, question)
        held.append((toks, prefix_end(cls), _kept_after_prefill(engine, prepared, tmp_path / f"{k}.jsonl")[1]))
    (toks, end, a), (toks2, end2, b) = held
    assert len(toks) == len(toks2) and toks != toks2 and end == end2
    for il in range(qwen05_model.n_layer):
        cat_a, cat_b = {p for p in a[il] if p < end}, {p for p in b[il] if p < end}
        assert cat_a == cat_b, il
        assert len(cat_a) < 0.5 * end  # the catalog was cut


@pytest.mark.slow
def test_pask_zip_at_budget_one_is_full_kv(qwen05_model):
    full = _engine(qwen05_model, "full", budget=1.0)
    ours = _engine(qwen05_model, "pask-zip", budget=1.0)
    for question in ("What is the weather in Paris in celsius?", "Time in Tokyo now, please, and quickly?"):
        want = full.execute(_prompt(full, question)[0])
        got = ours.execute(_prompt(ours, question)[0])
        assert want.tokens and got.tokens == want.tokens and got.text == want.text


@pytest.mark.slow
def test_cli_compress_pask_zip_then_run_from_it(tmp_path, cli):
    import json

    tools, out = tmp_path / "tools.json", tmp_path / "zip.pkv"
    tools.write_text(json.dumps(TOOLS))
    model = ["--model", "qwen2.5-coder-0.5b"]
    done = cli("compress", *model, "--tools", str(tools), "--method", "pask-zip", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > 0
    ran = cli("run", *model, "--schema", str(tools), "--prefix", str(out), "What is the weather in Paris in celsius?")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["name"] in {t["function"]["name"] for t in TOOLS}


@pytest.mark.slow
def test_key_rows_read_the_cache_as_it_is(qwen05_model):
    """Layer 0's keys are RoPE-rotated projections of the token alone. NEOX RoPE turns each pair of
    dimensions (i, i + half a head) by an angle of the position, which keeps each pair's magnitude: the
    same token at two positions has the same pair magnitudes, other tokens differ (an oracle that needs
    no weights, and fails if rows are read shifted). An f16 and a q8_0 cache give the same key norms; bytes
    that are not such a state give one line."""
    from pask_local.engine.kv_stream import context_config
    from pask_local.errors import NativeError
    from pask_local.kv_layered import LayeredContext
    from pask_local.kv_rows import key_rows
    from pask_local.prefix import state as kv_state

    toks = qwen05_model.tokenize("alpha beta gamma delta " * 8)
    rows = {}
    for kv in ("f16", "q8_0"):
        ctx = LayeredContext(qwen05_model, [256] * qwen05_model.n_layer,
                             context_config(256, 64, kv, flash_attn=kv != "f16"))
        try:
            assert ctx.decode(toks, 0) == 0
            rows[kv] = key_rows(kv_state.save(ctx, 0)[1:])
        finally:
            ctx.close()
    pos, k = rows["f16"][0]
    assert sorted(pos.tolist()) == list(range(len(toks)))
    heads = k.reshape(len(pos), -1, 64)  # Qwen2.5-0.5B: 2 KV heads of 64
    pairs = np.hypot(heads[:, :, :32], heads[:, :, 32:]).reshape(len(pos), -1)
    same, other = [], []
    for a in range(len(pos)):
        for b in range(a + 1, len(pos)):
            d = float(np.abs(pairs[a] - pairs[b]).max() / pairs[a].max())
            (same if toks[pos[a]] == toks[pos[b]] else other).append(d)
    assert same and max(same) < min(other), (max(same), min(other))
    # layer 0 (the same input either way): a quantized cache stores keys turned by a Hadamard rotation,
    # which keeps each head's norm
    for il in (0,):
        (p16, k16), (p8, k8) = rows["f16"][il], rows["q8_0"][il]
        assert p16.tolist() == p8.tolist()
        n16, n8 = (np.linalg.norm(x.reshape(len(p16), -1, 64), axis=2) for x in (k16, k8))
        np.testing.assert_allclose(n8, n16, rtol=0.03)
    for bad in (b"\0" * 40, b"\0" * 8 + (0x4C564B50).to_bytes(4, "little") + b"\1" * 30):
        with pytest.raises(NativeError):
            key_rows(bad)


@pytest.mark.slow
def test_knorm_keeps_the_lowest_norm_keys_of_the_prefix(qwen05_model):
    from pask_local.engine.prescore import prompt_scores

    engine = _engine(qwen05_model, "knorm")
    _, toks, cls = _prompt(engine, "What is the weather in Paris in celsius?")
    end = prefix_end(cls)
    scores = prompt_scores(qwen05_model, engine.method, toks, end, engine.cfg)
    plan = engine.method.bind(0.33, cls, qwen05_model.n_layer, scores=scores)
    from pask_local.methods import LayerView

    view = LayerView(layer=5, n_layer=qwen05_model.n_layer, positions=np.arange(len(toks)), classes=cls,
                     prompt_len=len(toks), all_classes=cls)
    cap = plan.capacities[5]
    kept = plan.select(view, cap)
    free = [p for p in kept if 4 <= p < end]
    dropped = [p for p in range(4, end) if p not in set(kept)]
    assert np.all(scores[5][:end] < 0)  # minus a norm
    assert min(scores[5][free]) >= max(scores[5][dropped])  # the lowest norms (highest scores) stayed


def _kvpress_keydiff(keys):
    """KeyDiff's score on keys [batch, heads, seq, head_dim]: kvpress's own press where kvpress is
    installed (the optional extra), else the same two lines of torch written from the paper."""
    import torch.nn.functional as F

    try:
        from kvpress import KeyDiffPress
    except ImportError:
        anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)
        return -F.cosine_similarity(keys, anchor, dim=-1)
    return KeyDiffPress().score(None, None, keys, None, None, {})


@pytest.mark.slow
def test_keydiff_scores_are_kvpress_keydiff_over_the_prefix_keys(qwen05_model):
    """Oracle: kvpress's KeyDiffPress.score on the prefix's keys read from a separate plain prefill,
    averaged over KV heads, equals the scoring pass; the plan keeps the best-scored free positions."""
    import torch

    from pask_local.engine.kv_stream import context_config
    from pask_local.engine.prescore import prompt_scores
    from pask_local.kv_layered import LayeredContext
    from pask_local.kv_rows import key_rows
    from pask_local.methods import LayerView
    from pask_local.prefix import state as kv_state

    engine = _engine(qwen05_model, "keydiff")
    _, toks, cls = _prompt(engine, "What is the weather in Paris in celsius?")
    end = prefix_end(cls)
    scores = prompt_scores(qwen05_model, engine.method, toks, end, engine.cfg)
    cells = -(-(end + 1) // 256) * 256
    ctx = LayeredContext(qwen05_model, [cells] * qwen05_model.n_layer, context_config(cells, 64, "f16", False))
    try:
        assert ctx.decode(toks[:end], 0) == 0
        rows = key_rows(kv_state.save(ctx, 0)[1:])
    finally:
        ctx.close()
    for il in (0, 5, qwen05_model.n_layer - 1):
        pos, k = rows[il]
        order = np.argsort(pos)
        keys = torch.tensor(k[order].reshape(len(pos), -1, 64), dtype=torch.float64).permute(1, 0, 2)[None]
        want = _kvpress_keydiff(keys)[0].mean(dim=0).numpy()
        assert np.sort(pos).tolist() == list(range(end))
        np.testing.assert_allclose(scores[il][:end], want, atol=2e-3)
        assert np.all(scores[il][end:] == 0)
    plan = engine.method.bind(0.33, cls, qwen05_model.n_layer, scores=scores)
    view = LayerView(layer=5, n_layer=qwen05_model.n_layer, positions=np.arange(len(toks)), classes=cls,
                     prompt_len=len(toks), all_classes=cls)
    kept = set(plan.select(view, plan.capacities[5]).tolist())
    free = [p for p in range(4, end) if p in kept]
    dropped = [p for p in range(4, end) if p not in kept]
    assert free and dropped
    assert min(scores[5][free]) >= max(scores[5][dropped])
