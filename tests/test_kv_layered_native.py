"""Layered KV cache, native edge cases: architectures it refuses, bad arguments that must give an
error code (never a GGML_ASSERT abort), and sequence-id bookkeeping that must match upstream.

Bad-argument calls run in a subprocess through ctypes, so that an abort shows up as a signal
(return code < 0) instead of killing the test run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kv_layered_helpers import random_tokens, synthetic
from pask_local.calibration.synthetic import ATTENTION_ARCHS

from pask_local.kv_layered import (
    LayeredContext,
    LayeredKVError,
    UnsupportedArchitectureError,
    api,
    unsupported_reason,
)
from pask_local.llm import Context, ContextConfig, Model

N_LAYER = 3
REPO = Path(__file__).resolve().parent.parent


def cfg(n_seq_max: int = 1) -> ContextConfig:
    return ContextConfig(n_ctx=64, n_batch=16, n_seq_max=n_seq_max, n_threads=1)


@pytest.mark.parametrize("arch", ATTENTION_ARCHS)
def test_every_attention_architecture_is_supported(tmp_path, arch: str) -> None:
    model = Model(synthetic(tmp_path, arch, n_layer=N_LAYER))
    assert unsupported_reason(model) is None
    assert api().model_supported(model.ptr) == 0
    ctx = LayeredContext(model, [16] * N_LAYER, cfg())
    assert ctx.decode(random_tokens(6, model.n_vocab), 0) == 0
    assert [ctx.used(il) for il in range(N_LAYER)] == [6] * N_LAYER


def test_recurrent_architecture_gives_a_one_line_error_naming_it(tmp_path) -> None:
    model = Model(synthetic(tmp_path, "mamba", n_layer=2))
    # the C API: an error code and a reason naming the architecture
    assert api().model_supported(model.ptr) == -5
    native = api().last_error().decode()
    assert "'mamba'" in native and "recurrent" in native
    plain = Context(model, cfg())
    caps = (__import__("ctypes").c_uint32 * 2)(8, 8)
    assert not api().init(model.ptr, plain.params(), caps, 2)
    assert "'mamba'" in api().last_error().decode()
    # Python: a PaskError subclass with the same one line
    with pytest.raises(UnsupportedArchitectureError) as exc:
        LayeredContext(model, [8, 8], cfg())
    msg = str(exc.value)
    assert "\n" not in msg and "'mamba'" in msg and "recurrent" in msg
    assert isinstance(exc.value, LayeredKVError)


def test_unsupported_architecture_through_the_cli_is_one_line(tmp_path) -> None:
    from conftest import run_cli

    gguf = synthetic(tmp_path, "mamba", n_layer=2, n_ctx=4096)
    r = run_cli("run", "--gguf", str(gguf), "--schema", str(REPO / "examples" / "get_weather.json"),
                "--method", "pask", "--max-tokens", "8", "hi", env={"PASK_THREADS": "1"}, timeout=300)
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert err and err[-1].startswith("error: ") and "mamba" in err[-1], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


_BAD_ARGS_SCRIPT = textwrap.dedent('''
    import ctypes, json, sys
    sys.path.insert(0, sys.argv[2])
    from kv_layered_helpers import random_tokens
    from pask_local.attention import _fns
    from pask_local.kv_layered import LayeredContext, api
    from pask_local.llm import Context, ContextConfig, Model
    from pask_local.native import bind

    cell_pos = bind("pask_kv_cell_positions", ctypes.c_int32,
                    [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32])
    model = Model(sys.argv[1])
    out = {}
    buf = (ctypes.c_int32 * 64)()
    for unified in (False, True):
        cfg = ContextConfig(n_ctx=64, n_batch=16, n_seq_max=2, n_threads=1)
        lay = LayeredContext(model, [16] * model.n_layer, cfg, unified=unified)
        assert lay.decode(random_tokens(4, model.n_vocab), 0) == 0
        p = lay.ptr.value
        key = "unified" if unified else "split"
        out[key] = {
            "n_seq_ids": api().n_seq_ids(p),
            "cells_seq2": cell_pos(p, 0, 2, buf, 64),
            "cells_seq300": cell_pos(p, 0, 300, buf, 64),
            "cells_seq_neg": cell_pos(p, 0, -1, buf, 64),
            "cells_layer99": cell_pos(p, 99, 0, buf, 64),
            "cells_null_out": cell_pos(p, 0, 0, None, 8),
            "used_seq300": api().used(p, 0, 300),
            "evict_seq300": api().evict(p, 0, 300, (ctypes.c_int32 * 1)(0), 1),
            "positions_seq2": api().positions(p, 0, 2, buf, 64),
        }
        out[key]["last_error"] = api().last_error().decode()
    class _Split(Context):
        def params(self):
            q = super().params()
            q.kv_unified = False
            return q
    up = _Split(model, ContextConfig(n_ctx=64, n_batch=16, n_seq_max=2, n_threads=1))
    assert up.decode(random_tokens(4, model.n_vocab), 0) == 0
    out["upstream"] = {"cells_seq0": cell_pos(up.ptr, 0, 0, buf, 64), "cells_seq2": cell_pos(up.ptr, 0, 2, buf, 64),
                       "cells_seq300": cell_pos(up.ptr, 0, 300, buf, 64)}
    out["null_ctx"] = {"cells": cell_pos(None, 0, 0, buf, 64), "used": api().used(None, 0, 0),
                       "n_seq_ids": api().n_seq_ids(None), "supported": api().model_supported(None)}
    f = _fns()
    out["probe"] = {"huge": bool(f.init(2**31 - 1, 4)), "zero": bool(f.init(0, 4)), "neg_window": bool(f.init(4, -1))}
    print(json.dumps(out))
''')


def test_bad_arguments_give_error_codes_not_aborts(tmp_path) -> None:
    gguf = synthetic(tmp_path, "qwen2", n_layer=N_LAYER)
    script = tmp_path / "bad_args.py"
    script.write_text(_BAD_ARGS_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(gguf), str(Path(__file__).parent)],
                       capture_output=True, text=True, timeout=300, env={"PASK_THREADS": "1", **_env()})
    assert r.returncode == 0, f"native abort or crash (rc {r.returncode}): {r.stderr[-1500:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    split, unified = out["split"], out["unified"]
    # one stream per sequence: ids [0, 2); one shared stream: every id upstream accepts, [0, 256)
    assert split["n_seq_ids"] == 2 and unified["n_seq_ids"] == 256
    assert split["cells_seq2"] == -3 and split["positions_seq2"] == -3
    assert unified["cells_seq2"] == 16 and unified["positions_seq2"] == 0
    for d in (split, unified):
        assert d["cells_seq300"] == -3 and d["cells_seq_neg"] == -3 and d["used_seq300"] == -3
        assert d["evict_seq300"] == -3 and d["cells_layer99"] == -2 and d["cells_null_out"] == -4
        assert "out of range" in d["last_error"]
    up = out["upstream"]
    assert up["cells_seq0"] > 0 and up["cells_seq2"] == -3 and up["cells_seq300"] == -3
    assert out["null_ctx"] == {"cells": -4, "used": -1, "n_seq_ids": -1, "supported": -4}
    assert out["probe"] == {"huge": False, "zero": False, "neg_window": False}


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PASK_THREADS"}


def _pos_max(ctx: Context, seq_id: int) -> int:
    import llama_cpp.llama_cpp as raw

    return raw.llama_memory_seq_pos_max(ctx.memory, seq_id)


def test_unified_cache_keeps_the_high_water_mark_of_any_sequence_id_it_accepts(tmp_path) -> None:
    """A unified cache accepts sequence ids up to 255 (upstream maps them all to one stream); a copy
    to such an id must carry the source's high-water mark like a copy to an id < n_seq_max."""
    model = Model(synthetic(tmp_path, "llama", n_layer=N_LAYER))
    ctx = LayeredContext(model, [32] * N_LAYER, cfg(n_seq_max=2), unified=True)
    assert ctx.n_seq_ids == 256
    assert ctx.decode(random_tokens(8, model.n_vocab), 0) == 0
    for il in range(N_LAYER):
        assert ctx.evict(il, [7]) == 1          # the newest token, from every layer
    assert _pos_max(ctx, 0) == 7
    for dst in (1, 9, 255):
        ctx.seq_cp(0, dst)
        assert _pos_max(ctx, dst) == 7, dst
        assert ctx.positions(1, seq_id=dst) == list(range(7))
    with pytest.raises(LayeredKVError, match="out of range"):
        ctx.used(0, seq_id=256)


@pytest.mark.parametrize("unified", [False, True])
def test_seq_keep_resets_only_sequences_whose_stream_it_clears(tmp_path, unified: bool) -> None:
    """Upstream's seq_keep(s) clears other sequences only in s's stream: with one stream per sequence
    the others survive, and so must their high-water marks (decoding continues at the next position)."""
    model = Model(synthetic(tmp_path, "qwen2", n_layer=N_LAYER))
    toks = random_tokens(10, model.n_vocab, seed=2)
    ctx = LayeredContext(model, [32] * N_LAYER, cfg(n_seq_max=2), unified=unified)
    for s in (0, 1):
        assert ctx.decode(toks[:8], 0, seq_id=s) == 0
    for il in range(N_LAYER):
        assert ctx.evict(il, [7], seq_id=1) == 1
    assert _pos_max(ctx, 1) == 7
    ctx.seq_keep(0)
    if unified:
        # shared stream: sequence 1 is gone, exactly as upstream
        assert _pos_max(ctx, 1) == -1 and ctx.used(0, seq_id=1) == 0
        assert ctx.decode([toks[0]], 0, seq_id=1) == 0
    else:
        # own stream: sequence 1 survives with its cells and its next position
        assert ctx.used(0, seq_id=1) == 7 and _pos_max(ctx, 1) == 7
        assert ctx.decode([toks[8]], 8, seq_id=1) == 0
    assert _pos_max(ctx, 0) == 7 and ctx.decode([toks[8]], 8, seq_id=0) == 0
