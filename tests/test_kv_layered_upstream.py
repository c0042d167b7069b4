"""Oracle 1 for the layered KV cache: upstream llama.cpp.

Evicting the same positions in every layer of a layered context must give the logits that upstream
``llama_memory_seq_rm`` of those positions gives on a normal context (same model, same tokens).
Checked on the real Gemma 3 270M (iSWA graph path), the real Qwen2.5-Coder 0.5B and 1.5B (qwen2),
and on synthetic GGUFs of every attention
architecture we claim (qwen3, gemma3 with a short sliding window, llama, qwen2 with QKV biases, phi3
with fused QKV/gate_up, mistral3), flash attention off and on, one and two sequences.
"""

from __future__ import annotations

import numpy as np
import pytest
from kv_layered_helpers import feed, random_tokens, synthetic
from pask_local.calibration.synthetic import ATTENTION_ARCHS

from pask_local.kv_layered import LayeredContext
from pask_local.llm import Context, ContextConfig, Model

PROMPT = (
    "The library catalogue lists every book by author, title and year. Readers may borrow up to five "
    "books at a time and must return them within three weeks. Late returns cost ten cents a day. "
    "The reading room opens at nine and closes at six, except on Sundays when it stays closed. "
)


def _evict_everywhere(lay: LayeredContext, up: Context, positions: list[int], seq_id: int = 0) -> None:
    for il in range(lay.model.n_layer):
        assert lay.evict(il, positions, seq_id=seq_id) == len(positions)
    for p in positions:
        assert up.seq_rm(seq_id, p, p + 1)


def _compare(model: Model, prompt: list[int], cont: list[int], evicted: list[int], config: ContextConfig,
             n_seq: int = 1) -> float:
    """Max |logit diff| over the continuation tokens, on every sequence.

    Also checks that the eviction matters: a context that evicted nothing disagrees clearly."""
    up = Context(model, config)
    lay = LayeredContext(model, [config.n_ctx] * model.n_layer, config)
    worst = 0.0
    for s in range(n_seq):
        for c in (up, lay):
            assert c.decode(prompt, 0, seq_id=s) == 0
        np.testing.assert_allclose(lay.logits(), up.logits(), atol=1e-3)
    for s in range(n_seq):
        # a different eviction per sequence, so that sequences cannot leak into each other unnoticed
        _evict_everywhere(lay, up, evicted[s::n_seq] if n_seq > 1 else evicted, seq_id=s)
    plain = Context(model, config)
    for s in range(n_seq):
        assert plain.decode(prompt, 0, seq_id=s) == 0
    for s in range(n_seq):
        a = feed(lay, cont, len(prompt), seq_id=s)
        b = feed(up, cont, len(prompt), seq_id=s)
        worst = max(worst, float(np.abs(a - b).max()))
        # the eviction is visible: a context that evicted nothing disagrees clearly
        assert np.abs(feed(plain, cont, len(prompt), seq_id=s) - b).max() > 0.1
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["gemma_path", "qwen05_path", "qwen15_path"])
@pytest.mark.parametrize("fa", [False, True])
def test_real_model_same_eviction_in_every_layer_matches_upstream_seq_rm(request, fixture: str, fa: bool) -> None:
    """The real models: Gemma 3 270M (iSWA graph path) and the Qwen2.5-Coder instruct models (qwen2:
    QKV biases, GQA, Q4_K_M), as installed by scripts/setup (1.5B: by scripts/demo, else skipped)."""
    model = Model(request.getfixturevalue(fixture))
    toks = model.tokenize(PROMPT * 2, add_special=True)
    prompt, cont = toks[:-8], toks[-8:]
    assert len(prompt) > 100
    evicted = [*range(5, 25), *range(40, 48), 60, 63, 64, 90]
    config = ContextConfig(n_ctx=256, n_batch=64, flash_attn=fa)
    diff = _compare(model, prompt, cont, evicted, config)
    print(f"{model.path.name} fa={fa}: max |layered - upstream| = {diff:.2e}")
    assert diff == 0.0, "bit-identical to upstream seq_rm (same kernels, same order)"


@pytest.mark.parametrize("arch", ATTENTION_ARCHS)
@pytest.mark.parametrize("fa", [False, True])
@pytest.mark.parametrize("n_seq", [1, 2])
def test_synthetic_same_eviction_in_every_layer_matches_upstream(tmp_path, arch: str, fa: bool, n_seq: int) -> None:
    model = Model(synthetic(tmp_path, arch))
    toks = random_tokens(48, model.n_vocab, seed=7)
    prompt, cont = toks[:40], toks[40:]
    evicted = [1, 2, 3, 9, 15, 16, 22, 30, 31, 36]
    config = ContextConfig(n_ctx=256, n_batch=16, n_seq_max=n_seq, flash_attn=fa, n_threads=2)
    diff = _compare(model, prompt, cont, evicted, config, n_seq=n_seq)
    print(f"{arch} fa={fa} n_seq={n_seq}: max |layered - upstream| = {diff:.2e}")
    # same graph shapes and kernels on both sides: the logits are bit-identical, not merely close
    assert diff == 0.0
