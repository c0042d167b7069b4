"""Layered KV cache (patch 0002): capacity limits, clean errors, eviction, sequences, bad input.

Runs on small synthetic GGUFs. Tests need the pask-patched libllama and fail (not skip) without it.
"""

from __future__ import annotations

import numpy as np
import pytest
from kv_layered_helpers import feed, random_tokens, synthetic
from pask_local.calibration.synthetic import ATTENTION_ARCHS

from pask_local.errors import PaskError
from pask_local.kv_layered import LayeredContext, LayeredKVError, kv_total_bytes
from pask_local.llm import Context, ContextConfig, Model
from pask_local.model_info import swa_layers

N_LAYER = 4


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Model:
    return Model(synthetic(tmp_path_factory.mktemp("kv"), "qwen3", n_layer=N_LAYER))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Model:
    return Model(synthetic(tmp_path_factory.mktemp("kv"), "gemma3", n_layer=N_LAYER))


def cfg(n_seq_max: int = 1, fa: bool = False) -> ContextConfig:
    return ContextConfig(n_ctx=128, n_batch=32, n_seq_max=n_seq_max, flash_attn=fa, n_threads=2)


@pytest.mark.parametrize("fa", [False, True])
def test_filling_a_layer_past_capacity_fails_cleanly_then_eviction_makes_room(qwen: Model, fa: bool) -> None:
    caps = [40, 40, 12, 40]
    ctx = LayeredContext(qwen, caps, cfg(fa=fa))
    toks = random_tokens(20, qwen.n_vocab)
    assert [ctx.capacity(i) for i in range(N_LAYER)] == caps
    assert ctx.decode(toks[:12], 0) == 0
    assert ctx.used(2) == 12 and ctx.free(2) == 0
    # layer 2 is full: the next token must be refused with a status code, and nothing changes
    assert ctx.decode([toks[12]], 12) != 0
    assert [ctx.used(i) for i in range(N_LAYER)] == [12] * N_LAYER
    # a batch larger than the smallest capacity is refused on a fresh context as well
    fresh = LayeredContext(qwen, caps, cfg(fa=fa))
    assert fresh.decode(toks[:13], 0) != 0
    assert all(fresh.used(i) == 0 for i in range(N_LAYER))
    # evicting in layer 2 only frees room in layer 2; decoding then continues
    assert ctx.evict(2, [1, 2, 3]) == 3
    assert ctx.free(2) == 3 and ctx.used(2) == 9 and ctx.used(1) == 12
    assert ctx.decode(toks[12:15], 12) == 0
    assert ctx.decode([toks[15]], 15) != 0
    pos2 = ctx.positions(2)
    assert sorted(pos2) == [0, *range(4, 15)]
    # the holes were refilled in cell order: cells 1..3 now hold positions 12..14
    assert pos2[1:4] == [12, 13, 14]
    assert ctx.positions(0) == list(range(15))


def test_evicting_positions_not_held_frees_nothing(qwen: Model) -> None:
    ctx = LayeredContext(qwen, [32] * N_LAYER, cfg())
    assert ctx.decode(random_tokens(8, qwen.n_vocab), 0) == 0
    assert ctx.evict(0, [100, 200]) == 0
    assert ctx.evict(0, [3, 3, 3]) == 1
    assert ctx.evict(0, [3]) == 0
    assert ctx.used(0) == 7 and ctx.used(1) == 8


def test_evicting_the_newest_token_everywhere_keeps_positions_consecutive(qwen: Model) -> None:
    ctx = LayeredContext(qwen, [32] * N_LAYER, cfg())
    toks = random_tokens(10, qwen.n_vocab)
    assert ctx.decode(toks[:8], 0) == 0
    for il in range(N_LAYER):
        assert ctx.evict(il, [7]) == 1
    # the batch validator wants the next token at max position + 1: still 8, not 7
    assert ctx.decode([toks[8]], 8) == 0
    assert 7 not in ctx.positions(0) and 8 in ctx.positions(0)


@pytest.mark.parametrize("unified", [False, True])
def test_eviction_in_one_sequence_does_not_touch_another(qwen: Model, unified: bool) -> None:
    toks = random_tokens(24, qwen.n_vocab, seed=3)
    ctx = LayeredContext(qwen, [48] * N_LAYER, cfg(n_seq_max=2), unified=unified)
    solo = LayeredContext(qwen, [48] * N_LAYER, cfg())
    for s in (0, 1):
        assert ctx.decode(toks[:16], 0, seq_id=s) == 0
    assert solo.decode(toks[:16], 0) == 0
    evicted = [2, 5, 6, 9]
    assert ctx.evict(1, evicted, seq_id=0) == len(evicted)
    assert ctx.positions(1, seq_id=1) == list(range(16))
    assert ctx.used(1, seq_id=0) == 12 and ctx.used(1, seq_id=1) == 16
    # sequence 1 continues exactly like an untouched single-sequence context
    got1 = feed(ctx, toks[16:20], 16, seq_id=1)
    want1 = feed(solo, toks[16:20], 16)
    np.testing.assert_allclose(got1, want1, atol=1e-3)
    # sequence 0 sees the eviction: its logits move away from the untouched ones
    got0 = feed(ctx, toks[16:20], 16, seq_id=0)
    assert np.abs(got0 - want1).max() > 1e-2


def _upstream(model: Model, config: ContextConfig, unified: bool) -> Context:
    class _Upstream(Context):
        def params(self):
            p = super().params()
            p.kv_unified = unified
            return p

    return _Upstream(model, config)


def _pos_range(ctx: Context, seq_id: int) -> tuple[int, int]:
    import llama_cpp.llama_cpp as raw

    return raw.llama_memory_seq_pos_min(ctx.memory, seq_id), raw.llama_memory_seq_pos_max(ctx.memory, seq_id)


@pytest.mark.parametrize("unified", [False, True])
def test_whole_sequence_ops_match_upstream(qwen: Model, unified: bool) -> None:
    """clear / seq_cp / seq_keep / seq_rm of whole sequences behave as on an upstream context."""
    import llama_cpp.llama_cpp as raw

    toks = random_tokens(24, qwen.n_vocab, seed=4)
    lay = LayeredContext(qwen, [48] * N_LAYER, cfg(n_seq_max=2), unified=unified)
    up = _upstream(qwen, ContextConfig(n_ctx=48, n_batch=32, n_seq_max=2, n_threads=2), unified)
    both = (lay, up)

    def same_state() -> None:
        for s in (0, 1):
            assert _pos_range(lay, s) == _pos_range(up, s)

    for c in both:
        assert c.decode(toks[:12], 0, seq_id=0) == 0
        raw.llama_memory_seq_cp(c.memory, 0, 1, -1, -1)
    a = [feed(c, toks[12:15], 12, seq_id=1) for c in both]
    b = [feed(c, toks[12:15], 12, seq_id=0) for c in both]
    np.testing.assert_allclose(a[0], a[1], atol=1e-3)
    np.testing.assert_allclose(b[0], b[1], atol=1e-3)
    np.testing.assert_allclose(a[0], b[0], atol=1e-3)
    assert lay.positions(0, seq_id=1) == list(range(15))
    same_state()
    for c in both:
        raw.llama_memory_seq_keep(c.memory, 1)
    same_state()
    if unified:
        assert all(lay.used(i, seq_id=0) == 0 for i in range(N_LAYER))
    for c in both:
        assert raw.llama_memory_seq_rm(c.memory, 1, 0, -1)
    same_state()
    assert all(lay.used(i, seq_id=1) == 0 for i in range(N_LAYER))
    a = [feed(c, toks[:4], 0, seq_id=1) for c in both]
    np.testing.assert_allclose(a[0], a[1], atol=1e-3)
    for c in both:
        c.clear()
    same_state()
    assert all(lay.used(i, seq_id=s) == 0 for i in range(N_LAYER) for s in (0, 1))
    assert all(lay.free(i) == 48 for i in range(N_LAYER))
    a = [feed(c, toks[:4], 0) for c in both]
    np.testing.assert_allclose(a[0], a[1], atol=1e-3)


def test_seq_cp_carries_per_layer_evictions(qwen: Model) -> None:
    toks = random_tokens(16, qwen.n_vocab, seed=5)
    ctx = LayeredContext(qwen, [32] * N_LAYER, cfg(n_seq_max=2), unified=True)
    assert ctx.decode(toks[:12], 0) == 0
    assert ctx.evict(2, [1, 4, 7]) == 3
    ctx.seq_cp(0, 1)
    assert ctx.positions(2, seq_id=1) == ctx.positions(2, seq_id=0)
    assert len(ctx.positions(2, seq_id=1)) == 9 and len(ctx.positions(1, seq_id=1)) == 12
    np.testing.assert_allclose(feed(ctx, toks[12:14], 12, seq_id=1), feed(ctx, toks[12:14], 12, seq_id=0), atol=1e-3)


def test_capacity_is_real_bytes_scale_with_capacity(qwen: Model) -> None:
    n_ctx = 768  # a multiple of 256: upstream pads n_ctx to it
    full = Context(qwen, ContextConfig(n_ctx=n_ctx, n_batch=32, n_threads=2))
    lay_full = LayeredContext(qwen, [n_ctx] * N_LAYER, cfg())
    lay_third = LayeredContext(qwen, [n_ctx // 3] * N_LAYER, cfg())
    # a layered cache at full capacity allocates what upstream allocates
    assert kv_total_bytes(lay_full) == kv_total_bytes(full) == lay_full.kv_bytes()
    ratio = lay_third.kv_bytes() / lay_full.kv_bytes()
    print(f"K/V bytes: upstream {kv_total_bytes(full)}, layered 1.0 {lay_full.kv_bytes()}, "
          f"layered 1/3 {lay_third.kv_bytes()} (ratio {ratio:.3f})")
    assert ratio == pytest.approx(1 / 3, abs=0.01)
    k, v = lay_third.layer_bytes(0)
    k_full, v_full = lay_full.layer_bytes(0)
    assert k == k_full // 3 and v == v_full // 3


def test_per_layer_capacities_give_per_layer_bytes(gemma: Model) -> None:
    caps = [64, 16, 32, 8]
    ctx = LayeredContext(gemma, caps, cfg())
    per_cell = [sum(ctx.layer_bytes(i)) / c for i, c in enumerate(caps)]
    assert len(set(per_cell)) == 1 and per_cell[0] > 0


def test_bad_input_raises_clear_errors(qwen: Model) -> None:
    with pytest.raises(LayeredKVError, match="at least 1 cell"):
        LayeredContext(qwen, [8, 0, 8, 8], cfg())
    with pytest.raises(LayeredKVError, match="one capacity per layer"):
        LayeredContext(qwen, [8, 8], cfg())
    ctx = LayeredContext(qwen, [8] * N_LAYER, cfg(n_seq_max=2))
    with pytest.raises(LayeredKVError, match="out of range"):
        ctx.evict(N_LAYER, [0])
    with pytest.raises(LayeredKVError, match="out of range"):
        ctx.used(-1)
    with pytest.raises(LayeredKVError, match="negative position"):
        ctx.evict(0, [1, -2])
    with pytest.raises(LayeredKVError, match="sequence id"):
        ctx.positions(0, seq_id=2)
    with pytest.raises(LayeredKVError, match="must be an integer"):
        ctx.evict(0, [1.5])
    assert ctx.evict(np.int64(1), np.array([0, 1], dtype=np.int32)) == 0  # numpy ints are fine
    assert issubclass(LayeredKVError, PaskError)


def test_native_api_rejects_bad_arguments_without_crashing(qwen: Model) -> None:
    """The C entry points validate too (the Python checks are bypassed here)."""
    import ctypes

    from pask_local.kv_layered import api

    ctx = LayeredContext(qwen, [8] * N_LAYER, cfg())
    p = ctx.ptr.value
    arr = (ctypes.c_int32 * 2)(1, -5)
    assert api().evict(p, 0, 0, arr, 2) == -4
    assert b"negative" in api().last_error()
    assert api().evict(p, 99, 0, arr, 1) == -2
    assert api().used(p, 0, 256) == -3  # a single stream accepts ids < 256, as upstream
    plain = Context(qwen, cfg())
    assert api().n_layer(plain.ptr) == -1
    caps = (ctypes.c_uint32 * N_LAYER)(8, 8, 0, 8)
    assert not api().init(qwen.ptr, plain.params(), caps, N_LAYER)
    assert b"must be >= 1" in api().last_error()


@pytest.mark.parametrize("arch", ATTENTION_ARCHS)
def test_budget_holds_on_every_architecture(tmp_path, arch: str) -> None:
    """Per-layer capacities are hard limits and real bytes, whatever the attention architecture."""
    model = Model(synthetic(tmp_path, arch, n_layer=N_LAYER))
    caps = [24, 10, 24, 16]
    ctx = LayeredContext(model, caps, cfg())
    toks = random_tokens(16, model.n_vocab, seed=11)
    assert ctx.decode(toks[:10], 0) == 0
    assert ctx.free(1) == 0 and ctx.decode([toks[10]], 10) != 0        # layer 1 full: refused, unchanged
    assert [ctx.used(i) for i in range(N_LAYER)] == [10] * N_LAYER
    assert ctx.evict(1, [2, 5]) == 2 and ctx.decode(toks[10:12], 10) == 0
    assert [ctx.used(i) for i in range(N_LAYER)] == [12, 10, 12, 12]
    assert all(ctx.used(i) <= c for i, c in enumerate(caps))
    per_cell = {sum(ctx.layer_bytes(i)) / c for i, c in enumerate(caps)}
    assert len(per_cell) == 1 and per_cell.pop() > 0
    if not swa_layers(model)[0]:
        # no sliding window: a layered cache at full capacity allocates what upstream allocates
        n_ctx = 256
        full = Context(model, ContextConfig(n_ctx=n_ctx, n_batch=32, n_threads=1))
        assert LayeredContext(model, [n_ctx] * N_LAYER, cfg()).kv_bytes() == kv_total_bytes(full)
