"""Model and context lifetimes: a context's destructor reads its model, so ``Model.close`` (or the
model's finalizer, which in a garbage cycle may run first) frees the model only once the last
context on it has closed. ASan found the use-after-free this prevents (scripts/sanitize_check)."""

from __future__ import annotations

from pask_local.calibration.synthetic import write_synthetic_gguf

from pask_local.llm import Context, ContextConfig, Model


def test_model_closed_before_its_context_is_freed_after_it(tmp_path):
    model = Model(write_synthetic_gguf(tmp_path / "m.gguf", "qwen3", n_layer=2, n_vocab=320))
    a, b = Context(model, ContextConfig(n_ctx=64, n_batch=16)), Context(model, ContextConfig(n_ctx=64, n_batch=16))
    model.close()
    assert model.ptr is not None                   # two contexts still use it
    assert a.decode([1, 2, 3], 0) == 0             # and they still work
    a.close()
    assert model.ptr is not None
    b.close()
    assert model.ptr is None                       # the last context freed it
    model.close()                                  # idempotent

