"""Shared helpers of the layered-KV-cache tests: synthetic models, greedy feeding, logits capture."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pask_local.llm import Context


def synthetic(tmp_dir: Path, arch: str, dtype: str = "f32", n_layer: int = 4, seed: int = 1, **dims) -> Path:
    """A small random-weight GGUF written with the gguf package (never a measure of accuracy)."""
    from pask_local.calibration.synthetic import write_synthetic_gguf

    return write_synthetic_gguf(tmp_dir / f"{arch}-{dtype}-{n_layer}-{seed}.gguf", arch=arch, n_layer=n_layer,
                                dtype=dtype, seed=seed, **dims)


def feed(ctx: Context, tokens: list[int], pos0: int, seq_id: int = 0) -> np.ndarray:
    """Decode ``tokens`` one by one at pos0.. in ``seq_id``; logits after each token [len, n_vocab]."""
    out = []
    for i, t in enumerate(tokens):
        rc = ctx.decode([t], pos0 + i, seq_id=seq_id)
        assert rc == 0, f"llama_decode returned {rc} at position {pos0 + i}"
        out.append(ctx.logits())
    return np.stack(out)


def random_tokens(n: int, n_vocab: int, seed: int = 0, low: int = 259) -> list[int]:
    """Token ids above the synthetic vocab's specials and byte tokens."""
    return np.random.default_rng(seed).integers(low, n_vocab, n).tolist()
