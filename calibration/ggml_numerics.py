"""Optional emulation of ggml-cpu's numerics, so the reference can track llama.cpp's CPU results closely.

llama.cpp does not compute a quantized model's matmuls in float32: before ``W @ x`` the CPU backend
converts the activation row ``x`` to the weight type's ``vec_dot_type`` (ggml-cpu.c type traits):
Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 -> Q8_0 (blocks of 32, fp16 scale), K-quants -> Q8_K (blocks of 256,
float32 scale), F16 -> F16, BF16 -> BF16. The default KV cache is F16, so K/V are rounded to f16
and, in the non-flash attention path, Q (for K^T Q) and the softmax probabilities (for V P) are
converted to f16 as well. GELU goes through an fp16 lookup table (GGML_GELU_FP16), and RoPE
angles come from a float32 cache (``theta *= theta_scale`` per pair). These functions reproduce
those roundings, nothing more: the math stays the reference's own.

The activation quantizers are bit-exact to ggml-cpu's x86 ``from_float`` (tests/test_ggml_numerics.py
calls ggml's own). What remains between the reference and llama.cpp is summation order inside the
matmuls (~2e-7 relative), which an occasional flipped 8-bit rounding amplifies; llama.cpp's own
batch and token-by-token runs differ by the same mechanism (scripts/check_reference.py prints both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# GGUF tensor type name -> activation format used by ggml-cpu's vec_dot for that weight type
_ACT_FORMAT = {
    "F32": "f32", "F16": "f16", "BF16": "bf16",
    "Q4_0": "q8_0", "Q4_1": "q8_0", "Q5_0": "q8_0", "Q5_1": "q8_0", "Q8_0": "q8_0", "IQ4_NL": "q8_0",
}


def act_format(gguf_type: str) -> str:
    """The activation format ggml-cpu quantizes to before a matmul with a ``gguf_type`` weight."""
    return _ACT_FORMAT.get(gguf_type, "q8_K")


@dataclass(frozen=True)
class GGMLNumerics:
    """Which ggml-cpu roundings the reference reproduces (all on = llama.cpp CPU defaults)."""

    act_quant: bool = True      # activation -> vec_dot_type before each weight matmul
    kv_f16: bool = True         # F16 KV cache: K, V, Q (for KQ) and probs (for KQV) rounded to f16
    gelu_table: bool = True     # GELU through the fp16 table
    rope_cache: bool = True     # RoPE angles as ggml_rope_cache_init computes them (float32 powers)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """Round-trip x [..., K] through Q8_0 as ggml-cpu's x86 quantize_row_q8_0 does it: scale by
    id = 127/amax (not 1/d: the two differ in the last bit, enough to move a rounding tie), round
    half to even, keep d = amax/127 as fp16."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    # tensor / tensor: torch computes ``scalar / tensor`` as reciprocal-then-multiply (two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, torch.ones_like(amax)),
                      torch.zeros_like(amax))
    q = torch.round(xb * inv)
    return (q * d.half().float()).reshape(shape)


def quantize_q8_K(x: torch.Tensor) -> torch.Tensor:
    """Round-trip x [..., K] through Q8_K (ggml quantize_row_q8_K: iscale = -127/max, d = 1/iscale)."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // 256, 256)
    idx = xb.abs().argmax(-1, keepdim=True)
    mx = torch.gather(xb, -1, idx)
    nz = mx != 0
    iscale = torch.where(nz, torch.full_like(mx, -127.0) / torch.where(nz, mx, torch.ones_like(mx)), torch.zeros_like(mx))
    q = torch.clamp(torch.round(iscale * xb), max=127.0)
    d = torch.where(nz, 1.0 / torch.where(nz, iscale, torch.ones_like(iscale)), torch.zeros_like(iscale))
    return (q * d).reshape(shape)


def round_activation(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x as ggml-cpu sees it when multiplying with a weight whose activation format is ``fmt``."""
    if fmt == "f32":
        return x
    if fmt == "f16":
        return x.half().float()
    if fmt == "bf16":
        return x.bfloat16().float()
    if x.shape[-1] % (32 if fmt == "q8_0" else 256):
        return x  # ggml would not have quantized such a row either (no such weight type possible)
    return quantize_q8_0(x) if fmt == "q8_0" else quantize_q8_K(x)


def f16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def gelu_tanh_table(x: torch.Tensor) -> torch.Tensor:
    """ggml_vec_gelu_f32 with GGML_GELU_FP16: y = f16(gelu(f16(x))), 0 below -10, x above 10."""
    y = F.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, y))


def rope_angles(pos: torch.Tensor, base: float, freq_scale: float, n_rot: int) -> torch.Tensor:
    """RoPE angles [T, n_rot/2] as ggml-cpu's rope cache computes them: theta_scale =
    powf(base, -2.0f/n_rot); theta starts at (float) p and is multiplied by theta_scale in float32
    for each pair; the angle is freq_scale * theta in float32. Returned as float64 so that cos/sin
    of it round once to float32, like cosf/sinf."""
    f32 = torch.float32
    expo = torch.tensor(-2.0, dtype=f32) / torch.tensor(float(n_rot), dtype=f32)
    ts = torch.tensor(float(base), dtype=torch.float64).pow(expo.double()).to(f32)
    fs = torch.tensor(float(freq_scale), dtype=f32)
    theta = pos.to(f32)
    cols = []
    for _ in range(n_rot // 2):
        cols.append(theta * fs)
        theta = theta * ts
    return torch.stack(cols, dim=-1).double()
