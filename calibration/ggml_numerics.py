"""Optional emulation of ggml-cpu's numerics, so the reference can track llama.cpp's CPU results closely.

llama.cpp does not compute a quantized model's matmuls in float32: before ``W @ x`` the CPU backend
converts the activation row ``x`` to the weight type's ``vec_dot_type`` (ggml-cpu.c type traits):
Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 -> Q8_0 (blocks of 32, fp16 scale), K-quants -> Q8_K (blocks of 256,
float32 scale), F16 -> F16, BF16 -> BF16. The default KV cache is F16, so K/V are rounded to f16
and, in the non-flash attention path, Q (for K^T Q) and the softmax probabilities (for V P) are
converted to f16 as well. GELU goes through an fp16 lookup table (GGML_GELU_FP16). These functions
reproduce those roundings (formulas of ggml's reference quantizers), nothing more: the math stays
the reference's own.
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


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """Round-trip x [..., K] through Q8_0 (ggml quantize_row_q8_0: d = amax/127 stored as fp16)."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv)
    return (q * d.half().float()).reshape(shape)


def quantize_q8_K(x: torch.Tensor) -> torch.Tensor:
    """Round-trip x [..., K] through Q8_K (ggml quantize_row_q8_K: iscale = -127/max, d = 1/iscale)."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // 256, 256)
    idx = xb.abs().argmax(-1, keepdim=True)
    mx = torch.gather(xb, -1, idx)
    nz = mx != 0
    iscale = torch.where(nz, -127.0 / torch.where(nz, mx, torch.ones_like(mx)), torch.zeros_like(mx))
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
