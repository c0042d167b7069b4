"""Read a GGUF file into torch: hyperparameters from its metadata and dequantized weight tensors.

Dequantization uses the ``gguf`` package's own quant code (``gguf.quants.dequantize``), so every
type it supports (F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q6_K, ...) works. Tensors keep their GGUF names
(``token_embd.weight``, ``blk.3.attn_q.weight``...) and are returned in torch's ``[out, in]`` layout,
i.e. numpy order = reversed GGUF ``ne`` order. Hyperparameters are resolved the way llama.cpp's
loader resolves them (defaults included) for the architectures the reference model implements.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pask_local.errors import ModelError

SUPPORTED_ARCHS = ("qwen3", "gemma3", "qwen2", "llama", "mistral3", "phi3")
#: llama.cpp's LLAMA_ROPE_TYPE_NORM archs (rotate adjacent pairs); the others here are NEOX (halves)
ROPE_NORM_ARCHS = ("llama", "mistral3")


@dataclass(frozen=True)
class Hparams:
    """The hyperparameters the reference forward needs, as llama.cpp resolves them."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int                 # key length == value length (both archs)
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float              # global (non-SWA) layers
    rope_freq_scale: float        # 1 / linear rope scaling factor, global layers
    rope_base_swa: float          # SWA layers (gemma3)
    n_rot: int
    n_swa: int                    # 0: no sliding window
    swa_layers: tuple[bool, ...] = field(default=())
    attn_scale: float = 1.0
    embd_scale: float = 1.0
    final_logit_softcap: float = 0.0
    rope_neox: bool = True        # NEOX rotation (pairs i, i + n_rot/2) or NORM (pairs 2i, 2i + 1)
    pre_scale_q: bool = False     # Q is scaled before K^T Q (gemma3, phi3) instead of the scores

    def is_swa(self, layer: int) -> bool:
        return self.n_swa > 0 and self.swa_layers[layer]


class GGUFFile:
    """An open GGUF file: metadata access and per-tensor dequantization to torch."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"GGUF file not found: {self.path}")
        try:
            self._reader = gguf.GGUFReader(self.path)
        except Exception as exc:
            raise ModelError(f"cannot read GGUF {self.path}: {exc}") from None
        self._tensors = {t.name: t for t in self._reader.tensors}

    # --- metadata ---------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def get(self, key: str, default=None):
        """A metadata value as a Python scalar / str / list, or ``default`` when absent."""
        f = self._reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def require(self, key: str):
        v = self.get(key)
        if v is None:
            raise ModelError(f"{self.path.name}: missing GGUF metadata key {key!r}")
        return v

    @property
    def arch(self) -> str:
        return str(self.require("general.architecture"))

    # --- tensors ----------------------------------------------------------------------------
    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> str:
        return self._tensor(name).tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy/torch order (reversed GGUF ne)."""
        return tuple(int(d) for d in reversed(self._tensor(name).shape))

    def _tensor(self, name: str):
        t = self._tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path.name}: missing tensor {name!r}")
        return t

    def numpy(self, name: str) -> np.ndarray:
        """The tensor dequantized to a float32 numpy array in [out, in] (numpy) order."""
        import gguf

        t = self._tensor(name)
        shape = self.shape(name)
        qt = t.tensor_type
        if qt == gguf.GGMLQuantizationType.F32:
            arr = np.asarray(t.data, dtype=np.float32)
        elif qt == gguf.GGMLQuantizationType.F16:
            arr = np.asarray(t.data, dtype=np.float16).astype(np.float32)
        else:
            try:
                arr = gguf.quants.dequantize(np.asarray(t.data), qt)
            except NotImplementedError:
                raise ModelError(f"{self.path.name}: tensor {name} has unsupported type {qt.name}") from None
            arr = np.asarray(arr, dtype=np.float32)
        return arr.reshape(shape)

    def to_torch(self, name: str, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> torch.Tensor:
        arr = self.numpy(name)
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, copy=True, order="C")
        return torch.from_numpy(arr).to(device=device, dtype=dtype)

    def optional_torch(self, name: str, dtype: torch.dtype = torch.float32,
                       device: torch.device | str | None = None) -> torch.Tensor | None:
        return self.to_torch(name, dtype, device) if self.has_tensor(name) else None


def _uniform(values: Iterable[int] | int, what: str) -> int:
    if isinstance(values, list | tuple):
        vals = {int(v) for v in values}
        if len(vals) != 1:
            raise ModelError(f"per-layer {what} values {sorted(vals)} are not supported by the reference model")
        return vals.pop()
    return int(values)


def _refuse_unsupported_extras(g: GGUFFile, arch: str) -> None:
    """Features of llama / mistral3 / phi3 GGUFs the reference does not implement: a clear error."""
    if int(g.get(f"{arch}.expert_count", 0) or 0) > 0:
        raise ModelError(f"{arch} mixture-of-experts models are not supported by the reference model")
    if float(g.get(f"{arch}.attention.temperature_scale", 0.0) or 0.0) != 0.0:
        raise ModelError(f"{arch} attention temperature scaling is not supported by the reference model")
    for name in ("rope_freqs.weight", "blk.0.rope_freqs.weight", "rope_factors_long.weight",
                 "blk.0.rope_factors_long.weight"):
        if g.has_tensor(name):
            raise ModelError(f"{g.path.name}: per-frequency RoPE factors ({name}) are not supported by the "
                             "reference model")


def read_hparams(g: GGUFFile) -> Hparams:
    """Resolve hyperparameters like llama.cpp's ``load_hparams`` + the arch's ``load_arch_hparams``."""
    arch = g.arch
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"architecture {arch!r} is not supported by the reference model "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")

    def k(name: str) -> str:
        return f"{arch}.{name}"

    n_layer = int(g.require(k("block_count")))
    n_embd = int(g.require(k("embedding_length")))
    n_head = _uniform(g.require(k("attention.head_count")), "head_count")
    n_head_kv = _uniform(g.get(k("attention.head_count_kv"), n_head), "head_count_kv")
    n_ff = _uniform(g.require(k("feed_forward_length")), "feed_forward_length")
    head_dim = int(g.get(k("attention.key_length"), n_embd // n_head))
    head_dim_v = int(g.get(k("attention.value_length"), n_embd // n_head))
    if head_dim_v != head_dim:
        raise ModelError(f"key_length {head_dim} != value_length {head_dim_v} is not supported")
    for swa_key in ("attention.key_length_swa", "attention.value_length_swa", "rope.dimension_count_swa"):
        v = g.get(k(swa_key))
        if v is not None and int(v) != head_dim:
            raise ModelError(f"{k(swa_key)}={v} (different SWA head size) is not supported")
    n_rot = int(g.get(k("rope.dimension_count"), head_dim))
    if n_rot % 2 or n_rot > head_dim:
        raise ModelError(f"invalid rope dimension count {n_rot} for head size {head_dim}")
    rms_eps = float(g.require(k("attention.layer_norm_rms_epsilon")))
    rope_base = float(g.get(k("rope.freq_base"), 10000.0))

    scaling_type = str(g.get(k("rope.scaling.type"), "linear"))
    factor = float(g.get(k("rope.scaling.factor"), g.get(k("rope.scale_linear"), 0.0)) or 0.0)
    if scaling_type not in ("linear", "none") and factor not in (0.0, 1.0):
        raise ModelError(f"rope scaling type {scaling_type!r} is not supported by the reference model")
    rope_freq_scale = 1.0 if factor == 0.0 else 1.0 / factor

    if g.has_tensor("token_embd.weight"):
        n_vocab = g.shape("token_embd.weight")[0]
    else:
        raise ModelError(f"{g.path.name}: missing tensor 'token_embd.weight'")

    n_swa = 0
    swa_layers: tuple[bool, ...] = (False,) * n_layer
    rope_base_swa = 10000.0
    attn_scale = 1.0 / math.sqrt(head_dim)
    embd_scale = 1.0
    softcap = 0.0
    if arch == "gemma3":
        n_swa = int(g.get(k("attention.sliding_window"), 0) or 0)
        if n_swa > 0:
            pattern = g.get(k("attention.sliding_window_pattern"), 6)
            if isinstance(pattern, list | tuple):
                if len(pattern) < n_layer:
                    raise ModelError(f"sliding_window_pattern has {len(pattern)} entries for {n_layer} layers")
                swa_layers = tuple(bool(p) for p in pattern[:n_layer])
            else:
                n_pat = int(pattern)
                swa_layers = tuple(n_pat == 0 or (il % n_pat < n_pat - 1) for il in range(n_layer))
            rope_base_swa = float(g.get(k("rope.freq_base_swa"), 10000.0))
        softcap = float(g.get(k("final_logit_softcapping"), 0.0) or 0.0)
        embd_scale = math.sqrt(n_embd)
        # llama.cpp: the 27B (62 layers) scales by n_embd / n_head, the others by the key length.
        attn_scale = 1.0 / math.sqrt(n_embd / n_head if n_layer == 62 else head_dim)

    if arch in ("llama", "mistral3", "phi3"):
        _refuse_unsupported_extras(g, arch)
        attn_scale = float(g.get(k("attention.scale"), 0.0) or 0.0) or attn_scale

    return Hparams(
        rope_neox=arch not in ROPE_NORM_ARCHS, pre_scale_q=arch in ("gemma3", "phi3"),
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ff=n_ff, n_vocab=n_vocab,
        n_ctx_train=int(g.get(k("context_length"), 0) or 0), rms_eps=rms_eps,
        rope_base=rope_base, rope_freq_scale=rope_freq_scale, rope_base_swa=rope_base_swa,
        n_rot=n_rot, n_swa=n_swa, swa_layers=swa_layers, attn_scale=attn_scale,
        embd_scale=embd_scale, final_logit_softcap=softcap,
    )
