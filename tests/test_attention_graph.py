"""Attention statistics computed in the decode graph (patch 0007) against the eval-callback probe
(patch 0004), which reads upstream's own softmax tensors on the host: Gemma 3 270M (F16 cache,
sliding-window layers), a prompt in several chunks without a reset (SUM and WINDOW accumulate
over the ubatches, LAST is the last ubatch's), per-layer evictions, then single-token decodes
with a reset before each (as H2O and TOVA read them). The same operations run on two contexts,
so the cell layouts are equal and the statistics are compared cell by cell."""

from __future__ import annotations

import numpy as np
import pytest

from pask_local.attention import LAST, SUM, WINDOW, AttentionProbe, probed_layered_context
from pask_local.errors import NativeError
from pask_local.llm import ContextConfig

CHUNK, WIN = 24, 8


@pytest.fixture(scope="module")
def model(gemma_model):
    return gemma_model


def run_ops(model, probe, in_graph: bool, flash_attn: bool = False, stats=(SUM, WINDOW, LAST)):
    """Prefill 3 chunks, evict per layer, decode 4 tokens; the probe's statistics after each phase."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(10, 5000, size=3 * CHUNK + 4).tolist()
    cfg = ContextConfig(n_ctx=256, n_batch=CHUNK, flash_attn=flash_attn)
    ctx = probed_layered_context(model, [256] * model.n_layer, cfg, probe, stats=stats, in_graph=in_graph)
    seen = []
    try:
        probe.reset()
        for a in range(0, 3 * CHUNK, CHUNK):
            assert ctx.decode(tokens[a:a + CHUNK], a) == 0
        seen.append(snapshot(model, probe))
        for il in range(model.n_layer):
            ctx.evict(il, list(range(3 + il, 3 * CHUNK - 20, 3 + il % 4)))
        for i in range(3 * CHUNK, 3 * CHUNK + 4):
            probe.reset()
            assert ctx.decode([tokens[i]], i) == 0
            seen.append(snapshot(model, probe))
    finally:
        ctx.close()
    return seen


def snapshot(model, probe):
    return [{w: probe.stat(il, w) for w in (SUM, WINDOW, LAST)} for il in range(model.n_layer)]


def test_in_graph_statistics_equal_the_callback_readers(model):
    ref_probe, graph_probe = AttentionProbe(model.n_layer, WIN), AttentionProbe(model.n_layer, WIN)
    want = run_ops(model, ref_probe, in_graph=False)
    got = run_ops(model, graph_probe, in_graph=True)
    assert len(want) == len(got) == 5
    for phase, (w, g) in enumerate(zip(want, got, strict=True)):
        for il in range(model.n_layer):
            for what in (SUM, WINDOW, LAST):
                a, b = w[il][what], g[il][what]
                assert len(a) == len(b) > 0, (phase, il, what)
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=f"phase {phase} layer {il} stat {what}")
    # teeth: the prompt's three chunks accumulate (SUM holds every query: 72 per head, the window the
    # last WIN queries of each chunk), LAST is one query averaged over heads
    n_head = round(want[0][0][SUM].sum() / (3 * CHUNK))
    assert n_head >= 1 and abs(want[0][0][SUM].sum() - 3 * CHUNK * n_head) < 1e-2
    assert abs(want[0][0][WINDOW].sum() - 3 * WIN * n_head) < 1e-2
    assert abs(want[0][0][LAST].sum() - 1.0) < 1e-3
    ref_probe.close()
    graph_probe.close()


def test_flash_attention_statistics_match_at_the_first_layer(model):
    """With flash attention the graph recomputes the statistic's rows beside the fused kernel; the
    first layer sees the same inputs as without it (later layers differ by the kernel's F16 math)."""
    ref_probe, graph_probe = AttentionProbe(model.n_layer, WIN), AttentionProbe(model.n_layer, WIN)
    want = run_ops(model, ref_probe, in_graph=False)
    got = run_ops(model, graph_probe, in_graph=True, flash_attn=True)
    for phase, (w, g) in enumerate(zip(want, got, strict=True)):
        for what in (SUM, WINDOW, LAST):
            np.testing.assert_allclose(g[0][what], w[0][what], rtol=1e-3, atol=1e-4, err_msg=f"phase {phase} {what}")
        for il in range(model.n_layer):  # the mass itself is kept exactly: every query row sums to 1
            assert abs(g[il][SUM].sum() - w[il][SUM].sum()) < 1e-2 * max(1.0, w[il][SUM].sum())
    ref_probe.close()
    graph_probe.close()


def test_only_the_requested_statistics_are_computed(model):
    probe = AttentionProbe(model.n_layer, WIN)
    got = run_ops(model, probe, in_graph=True, stats=(WINDOW,))
    for snap in got:
        for layer in snap:
            assert not layer[SUM].any() and not layer[LAST].any()
    assert got[0][0][WINDOW].sum() > 0.5
    probe.close()


def test_a_disabled_probe_computes_nothing_and_resumes(model):
    probe = AttentionProbe(model.n_layer, WIN)
    cfg = ContextConfig(n_ctx=256, n_batch=CHUNK)
    ctx = probed_layered_context(model, [256] * model.n_layer, cfg, probe)
    tokens = list(range(100, 100 + CHUNK + 2))
    assert ctx.decode(tokens[:CHUNK], 0) == 0
    probe.reset()
    probe.set_enabled(False)
    assert ctx.decode([tokens[CHUNK]], CHUNK) == 0
    assert probe.n_kv(0) == 0 and not probe.stat(0, SUM).any()
    probe.set_enabled(True)
    assert ctx.decode([tokens[CHUNK + 1]], CHUNK + 1) == 0
    assert probe.n_kv(0) > CHUNK and abs(probe.stat(0, LAST).sum() - 1.0) < 1e-3
    probe.close()  # detaches: the context decodes on without it
    assert ctx.decode([5], CHUNK + 2) == 0
    ctx.close()


def test_each_stream_keeps_its_own_statistics(model):
    """A multi-stream cache (one KV stream per sequence, as the slot pool runs): two sequences decoded
    in one batch each get the statistics the callback probe reads for that sequence decoded alone."""
    from pask_local.kv_layered import LayeredContext

    rng = np.random.default_rng(11)
    prompts = [rng.integers(10, 5000, size=CHUNK).tolist() for _ in range(2)]
    nexts = [int(t) for t in rng.integers(10, 5000, size=2)]
    want = []
    for p, t in zip(prompts, nexts, strict=True):
        probe = AttentionProbe(model.n_layer, WIN)
        ctx = probed_layered_context(model, [256] * model.n_layer, ContextConfig(n_ctx=256, n_batch=CHUNK), probe,
                                     in_graph=False)
        assert ctx.decode(p, 0) == 0
        probe.reset()
        assert ctx.decode([t], CHUNK) == 0
        want.append([{w: probe.stat(il, w) for w in (SUM, LAST)} for il in range(model.n_layer)])
        ctx.close()
        probe.close()
    probe = AttentionProbe(model.n_layer, WIN)
    cfg = ContextConfig(n_ctx=512, n_batch=2 * CHUNK, n_seq_max=2, kv_unified=False)
    ctx = LayeredContext(model, [256] * model.n_layer, cfg, unified=False)
    probe.attach(ctx, (SUM, LAST), 256)
    assert ctx.decode_batch(prompts[0] + prompts[1], list(range(CHUNK)) * 2, [0] * CHUNK + [1] * CHUNK,
                            [False] * (2 * CHUNK)) == 0
    probe.reset()
    assert ctx.decode_batch(nexts, [CHUNK, CHUNK], [0, 1], [True, True]) == 0
    for seq in (0, 1):
        for il in range(model.n_layer):
            for what in (SUM, LAST):
                got, ref = probe.stat(il, what, seq), want[seq][il][what]
                n = min(len(got), len(ref))
                assert n > CHUNK and not got[n:].any() and not ref[n:].any()
                np.testing.assert_allclose(got[:n], ref[:n], rtol=1e-4, atol=1e-6,
                                           err_msg=f"sequence {seq} layer {il} stat {what}")
    # teeth: the two sequences attend differently
    assert not np.allclose(probe.stat(0, LAST, 0)[:CHUNK], probe.stat(0, LAST, 1)[:CHUNK], atol=1e-3)
    with pytest.raises(NativeError, match="sequence 2"):
        probe.stat(0, SUM, 2)
    probe.close()
    ctx.close()


def test_attaching_elsewhere_detaches_the_first_context(model):
    from pask_local.kv_layered import LayeredContext

    probe = AttentionProbe(model.n_layer, WIN)
    cfg = ContextConfig(n_ctx=256, n_batch=CHUNK)
    first, second = (LayeredContext(model, [256] * model.n_layer, cfg) for _ in range(2))
    probe.attach(first, (SUM,), 256)
    probe.attach(second, (SUM,), 256)
    probe.reset()
    assert first.decode(list(range(100, 100 + CHUNK)), 0) == 0  # computes nothing into the probe
    assert probe.n_kv(0) == 0 and not probe.stat(0, SUM).any()
    assert second.decode(list(range(100, 100 + CHUNK)), 0) == 0
    assert probe.n_kv(0) >= CHUNK
    probe.close()
    first.close()
    second.close()


def test_more_cells_than_the_probe_holds_is_an_error(model):
    probe = AttentionProbe(model.n_layer, WIN)
    cfg = ContextConfig(n_ctx=512, n_batch=CHUNK)
    from pask_local.kv_layered import LayeredContext

    ctx = LayeredContext(model, [512] * model.n_layer, cfg)
    probe.attach(ctx, (SUM,), n_cells=16)
    assert ctx.decode(list(range(100, 100 + CHUNK)), 0) == 0
    with pytest.raises(NativeError, match="more KV cells than the probe holds"):
        probe.stat(0, SUM)
    with pytest.raises(NativeError, match="unknown statistic"):
        probe.attach(ctx, (7,), n_cells=16)
    probe.close()
    ctx.close()
