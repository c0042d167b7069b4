"""The reference's emulation of ggml-cpu's activation quantizers is bit-exact: each emulated
round trip (Q8_0, Q8_K) equals what ggml-cpu's own ``from_float`` (the function its matmuls call
on every activation row) produces, read back through ctypes. Inputs include exact rounding ties,
where a reciprocal-then-multiply scale (what torch does for ``scalar / tensor``) rounds differently."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
import torch
from pask_local.calibration import ggml_numerics as gn

GGML_TYPE_Q8_0, GGML_TYPE_Q8_K = 8, 15
_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class _TypeTraitsCpu(ctypes.Structure):   # ggml-cpu.h: struct ggml_type_traits_cpu (leading fields)
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


@pytest.fixture(scope="module")
def ggml_cpu():
    path = Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"
    lib = ctypes.CDLL(str(path))
    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TypeTraitsCpu)
    return lib


def ggml_round_trip(lib, x: np.ndarray, ggml_type: int) -> np.ndarray:
    """x [rows, K] quantized by ggml-cpu's from_float for ``ggml_type`` and dequantized here."""
    from_float = _FROM_FLOAT(lib.ggml_get_type_traits_cpu(ggml_type).contents.from_float)
    block, size = (32, 34) if ggml_type == GGML_TYPE_Q8_0 else (256, 292)
    out = []
    for row in np.ascontiguousarray(x, dtype=np.float32):
        buf = (ctypes.c_uint8 * (row.size // block * size))()
        from_float(row.ctypes.data, ctypes.addressof(buf), row.size)
        b = np.frombuffer(buf, dtype=np.uint8).reshape(-1, size)
        if ggml_type == GGML_TYPE_Q8_0:   # block_q8_0: fp16 d, int8 qs[32]
            d = b[:, :2].copy().view(np.float16).astype(np.float32)
            q = b[:, 2:34].copy().view(np.int8).astype(np.float32)
        else:                             # block_q8_K: float d, int8 qs[256], int16 bsums[16]
            d = b[:, :4].copy().view(np.float32)
            q = b[:, 4:260].copy().view(np.int8).astype(np.float32)
        out.append((q * d).reshape(-1))
    return np.stack(out)


def activations(seed: int) -> np.ndarray:
    """Rows like a model's: heavy-tailed, plus rows built to hit x * 127/amax = k + 1/2 ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 512, generator=g) * torch.exp(torch.randn(64, 1, generator=g))
    x[::7] *= 50.0
    ties = torch.randint(-126, 126, (16, 512), generator=g).float() + 0.5
    ties[:, ::32] = 127.0                       # every Q8_0 block's amax maps to exactly 127
    ties[:, ::256] = 127.0
    scale = torch.exp(torch.randn(16, 1, generator=g))
    return torch.cat([x, ties * scale / 127.0]).numpy().astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("ggml_type", "emulate"), [(GGML_TYPE_Q8_0, gn.quantize_q8_0),
                                                     (GGML_TYPE_Q8_K, gn.quantize_q8_K)], ids=["q8_0", "q8_K"])
def test_round_trip_is_bit_exact(ggml_cpu, ggml_type, emulate, seed):
    x = activations(seed)
    ours = emulate(torch.from_numpy(x)).numpy()
    theirs = ggml_round_trip(ggml_cpu, x, ggml_type)
    assert np.array_equal(ours, theirs), f"{int((ours != theirs).sum())} of {ours.size} values differ"
