"""Oracle 2 for the layered KV cache: the independent torch reference forward.

On small synthetic GGUFs of every attention architecture we claim (F32 and F16 weights), different positions are evicted in
different layers at two moments of a decode, with capacities small enough that evicted cells get
refilled. The logits llama.cpp produces must match ``calibration.reference.ReferenceModel`` run
with per-layer masks that reproduce the timing: a token decoded before an eviction saw the evicted
key, a token decoded after it did not (in that layer only). The masks are also checked to matter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_layered_helpers import random_tokens, synthetic
from pask_local.calibration.synthetic import ATTENTION_ARCHS

from pask_local.kv_layered import LayeredContext
from pask_local.llm import ContextConfig, Model

pytestmark = pytest.mark.needs_torch

N_LAYER = 4
T = 48
PREFILL = 20
SECOND = 34
CAPACITY = 34  # PREFILL - 8 + 14 = 26 cells, then -6 + 14 = 34: full at the end, holes refilled


def _run(model: Model, fa: bool, seed: int) -> tuple[np.ndarray, torch.Tensor, list[int]]:
    """Decode T tokens with two rounds of per-layer evictions; (logits [T, V], mask [L, T, T], tokens)."""
    rng = np.random.default_rng(seed)
    toks = random_tokens(T, model.n_vocab, seed=seed)
    ctx = LayeredContext(model, [CAPACITY] * N_LAYER,
                         ContextConfig(n_ctx=64, n_batch=32, flash_attn=fa, n_threads=2))
    mask = torch.ones(N_LAYER, T, T, dtype=torch.bool)
    out = np.zeros((T, model.n_vocab), np.float32)

    def evict(t: int, per_layer: list[list[int]]) -> None:
        for il, pos in enumerate(per_layer):
            assert ctx.evict(il, pos) == len(pos)
            mask[il, t:, pos] = False

    assert ctx.decode(toks[:PREFILL], 0, logits="all") == 0
    for i in range(PREFILL):
        out[i] = ctx.logits(i)
    evict(PREFILL, [sorted(rng.choice(PREFILL, 8, replace=False).tolist()) for _ in range(N_LAYER)])
    for t in range(PREFILL, SECOND):
        assert ctx.decode([toks[t]], t) == 0
        out[t] = ctx.logits()
    second = []
    for il in range(N_LAYER):
        held = ctx.positions(il)
        if model.arch == "qwen3":  # gemma3's sliding-window layers also recycle out-of-window cells
            assert len(held) == PREFILL - 8 + (SECOND - PREFILL)
        second.append(sorted(rng.choice(held, 6, replace=False).tolist()))
    evict(SECOND, second)
    for t in range(SECOND, T):
        assert ctx.decode([toks[t]], t) == 0
        out[t] = ctx.logits()
    if model.arch == "qwen3":
        assert all(ctx.free(il) == 0 for il in range(N_LAYER))
    return out, mask, toks


@pytest.mark.parametrize("arch", ATTENTION_ARCHS)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("fa", [False, True])
def test_per_layer_eviction_matches_reference_forward(tmp_path, arch: str, dtype: str, fa: bool) -> None:
    from pask_local.calibration.reference import ReferenceModel

    path = synthetic(tmp_path, arch, dtype=dtype, n_layer=N_LAYER)
    ref = ReferenceModel.from_gguf(path)
    assert ref.n_layer == N_LAYER
    got, mask, toks = _run(Model(path), fa, seed=11)
    ids = torch.tensor(toks)
    want = ref.forward(ids, mask).numpy()
    unmasked = ref.forward(ids, None).numpy()

    diff = np.abs(got - want).max()
    effect = np.abs(want - unmasked)[PREFILL:].max()
    print(f"{arch} {dtype} fa={fa}: max|llama - ref| = {diff:.4f}, eviction effect = {effect:.3f}")
    assert diff < 0.03 * max(2.0, float(want.std()))   # F16 KV rounding scales with the logits
    assert effect > 20 * diff
    # argmax equal wherever the reference's top-2 margin is larger than the numeric noise
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * diff
    assert clear.sum() >= T * 3 // 4
    assert (got.argmax(1) == want.argmax(1))[clear].all()
