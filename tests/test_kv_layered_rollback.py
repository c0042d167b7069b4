"""Review fixes of the layered cache (issue 15, item 5), each a behaviour upstream llama.cpp has.

- A decode that fails mid-way (here: aborted by the abort callback) is rolled back by upstream
  (``seq_rm(s, first position of the ubatch, -1)``). The layered cache's high-water mark must then
  fall back to the position before the rolled-back ubatch, not to the highest position some layer
  still holds: positions evicted from every layer were decoded, and the next decode continues after
  them, as it does on upstream's cache.
- A sliding-window layer needs its window plus the longest prefill chunk: the last chunk of a
  compress-after-prefill method is ``probe_window`` long, which may exceed ``chunk``.
"""

from __future__ import annotations

import ctypes

import pytest
from conftest import REPO

from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.kv_layered import LayeredContext
from pask_local.llm import Context, ContextConfig, Model
from pask_local.native import lib
from pask_local.schema.tools import read_tools

pytestmark = pytest.mark.slow

_ABORT = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)


@pytest.fixture(scope="module")
def model(gemma_model) -> Model:
    return gemma_model


def _set_abort(ctx: Context, cb) -> None:
    fn = lib().llama_set_abort_callback
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, _ABORT, ctypes.c_void_p]
    fn(ctx.ptr, cb, None)


@pytest.mark.parametrize("layered", [False, True])
def test_decode_continues_after_an_aborted_decode_rolled_back(model, layered):
    """Upstream first (the oracle), then the layered cache with the newest positions evicted everywhere."""
    cfg = ContextConfig(n_ctx=256, n_batch=16)
    ctx = LayeredContext(model, [256] * model.n_layer, cfg) if layered else Context(model, cfg)
    toks = model.tokenize("one two three four five six seven eight")[:8]
    assert ctx.decode(toks, 0) == 0
    if layered:  # positions 5..7 leave every layer: decoded, but held nowhere
        for il in range(model.n_layer):
            ctx.evict(il, [5, 6, 7])
    abort = _ABORT(lambda _data: True)
    _set_abort(ctx, abort)
    assert ctx.decode([toks[0]], 8) != 0  # aborted: upstream rolls position 8 back
    keep = _ABORT(lambda _data: False)
    _set_abort(ctx, keep)
    assert ctx.decode([toks[0]], 8) == 0  # the next position is still 8
    ctx.close()


def test_sliding_window_layers_fit_a_probe_window_longer_than_the_chunk(model):
    """Gemma's sliding-window layers with a 96-token observation window and 16-token chunks."""
    tools = read_tools(REPO / "examples" / "get_weather.json") + read_tools(REPO / "examples" / "calendar.json")
    tools += read_tools(REPO / "examples" / "bfcl_math.json") + read_tools(REPO / "examples" / "parallel_shopping.json")
    cfg = EngineConfig(budget=0.33, max_tokens=8, chunk=16, probe_window=96, cell_align=1)
    engine = Engine(model, make_method("snapkv", model), cfg)
    res = engine.run(tools, "What is the weather like in Paris today? Answer in celsius. " * 12)
    assert res.stats["n_prompt"] > 600  # longer than the 512-token window + a chunk
    assert res.stats["n_gen"] > 0
