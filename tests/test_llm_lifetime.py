"""Model and context lifetimes: a context's destructor reads its model, so ``Model.close`` (or the
model's finalizer, which in a garbage cycle may run first) frees the model only once the last
context on it has closed. ASan found the use-after-free this prevents (scripts/sanitize_check)."""

from __future__ import annotations

import pytest
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



def test_pask_ngl_sets_the_default_offload(monkeypatch):
    from pask_local.errors import ModelError
    from pask_local.llm import default_gpu_layers

    monkeypatch.delenv("PASK_NGL", raising=False)
    assert default_gpu_layers() == 0
    monkeypatch.setenv("PASK_NGL", "99")
    assert default_gpu_layers() == 99
    for bad in ("all", "-1", "1.5"):
        monkeypatch.setenv("PASK_NGL", bad)
        with pytest.raises(ModelError, match="PASK_NGL"):
            default_gpu_layers()
