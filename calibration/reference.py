"""A plain-torch reference forward of Qwen3 / Gemma 3 GGUF models with per-layer attention masks.

It is the oracle that llama.cpp (stock and pask-patched) is checked against, and the model the
calibration signals are measured on. It follows llama.cpp's graphs (src/models/qwen3.cpp,
src/models/gemma3.cpp) with the weights exactly as stored in the GGUF:

- Qwen3: RMSNorm, QK-RMSNorm, NEOX RoPE (GGUF base), GQA, SwiGLU FFN, scale 1/sqrt(head_dim).
- Gemma 3: embeddings * sqrt(n_embd); RMSNorm weights used as stored (the converter already
  folded Gemma's ``1 + w``); pre/post attention and FFN norms; QK-norm; GELU(tanh)-gated FFN;
  attention scale 1/sqrt(key_length) (27B: 1/sqrt(n_embd/n_head)); sliding-window layers (window
  and SWA/global pattern from the GGUF, llama.cpp's default pattern 6) with their own RoPE base
  (``rope.freq_base_swa``, default 10000); optional final logit soft-capping.

Masks: ``attn_mask[l, i, j]`` = query i may attend key j in layer l. It is ANDed with causality
(key position <= query position) and, in SWA layers, the window (query_pos - key_pos < n_swa), as in
llama.cpp's ``is_masked_swa``. A query row left with no key gets a zero attention output.

Precision: weights live in ``dtype`` (float32 or bfloat16) and matmuls run in it; the residual
stream, norms, RoPE and softmax run in float32; logits are returned as float32. With
``numerics=GGMLNumerics()`` the reference additionally reproduces ggml-cpu's roundings (activation
quantization to the weight type's vec_dot_type, F16 KV cache, GELU table; see ggml_numerics.py),
which is what llama.cpp on CPU actually computes for a quantized model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pask_local.errors import PaskError

from . import ggml_numerics as gn
from .gguf_weights import GGUFFile, Hparams, read_hparams


class ReferenceInputError(PaskError):
    """Bad input to the reference model (token ids, masks, positions)."""


@dataclass
class _Linear:
    w: torch.Tensor                 # [out, in], compute dtype
    b: torch.Tensor | None = None   # float32
    act: str = "f32"                # ggml activation format for this weight's GGUF type


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    wq: _Linear
    wk: _Linear
    wv: _Linear
    wo: _Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    ffn_norm: torch.Tensor
    ffn_gate: _Linear
    ffn_up: _Linear
    ffn_down: _Linear
    attn_post_norm: torch.Tensor | None = None   # gemma3
    ffn_post_norm: torch.Tensor | None = None    # gemma3


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """llama.cpp's ggml_rms_norm followed by a multiply with the stored weight (float32)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


class ReferenceModel:
    """A torch forward over GGUF weights; see the module docstring for the exact semantics."""

    def __init__(self, hp: Hparams, tok_embd: torch.Tensor, output: _Linear, output_norm: torch.Tensor,
                 layers: list[_Layer], dtype: torch.dtype, device: torch.device,
                 numerics: gn.GGMLNumerics | None = None, path: str | None = None) -> None:
        self.hparams = hp
        self.dtype = dtype
        self.device = device
        self.path = path
        #: None: clean float math; a GGMLNumerics: reproduce those ggml-cpu roundings (mutable)
        self.numerics = numerics
        self._tok_embd = tok_embd
        self._output = output
        self._output_norm = output_norm
        self._layers = layers

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None,
                  numerics: gn.GGMLNumerics | None = None) -> ReferenceModel:
        """Load and dequantize every weight of a Qwen3 / Gemma 3 GGUF (slow for big vocabularies).

        numerics: None (default) for clean float math, or ``GGMLNumerics()`` to reproduce
        llama.cpp-CPU roundings (see ggml_numerics.py); can be changed later via ``.numerics``.
        """
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ReferenceInputError(f"unsupported reference dtype {dtype} (use float32 or bfloat16)")
        dev = torch.device(device) if device is not None else _default_device()
        g = GGUFFile(path)
        hp = read_hparams(g)

        def W(name: str) -> torch.Tensor:           # matrices in the compute dtype
            return g.to_torch(name, dtype, dev)

        def Lin(name: str) -> _Linear:
            return _Linear(W(name + ".weight"), B(name + ".bias"), gn.act_format(g.tensor_type(name + ".weight")))

        def N(name: str) -> torch.Tensor:           # norm weights stay float32
            return g.to_torch(name, torch.float32, dev)

        def B(name: str) -> torch.Tensor | None:
            return g.optional_torch(name, torch.float32, dev)

        q_rows, kv_rows = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        layers: list[_Layer] = []
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            if g.has_tensor(p + "attn_qkv.weight"):
                fused = Lin(p + "attn_qkv")
                ws = torch.split(fused.w, [q_rows, kv_rows, kv_rows], dim=0)
                if fused.b is not None:
                    bs: tuple[torch.Tensor | None, ...] = torch.split(fused.b, [q_rows, kv_rows, kv_rows])
                else:
                    bs = (B(p + "attn_q.bias"), B(p + "attn_k.bias"), B(p + "attn_v.bias"))
                wq, wk, wv = (_Linear(w, b, fused.act) for w, b in zip(ws, bs, strict=True))
            else:
                wq, wk, wv = Lin(p + "attn_q"), Lin(p + "attn_k"), Lin(p + "attn_v")
            layer = _Layer(
                attn_norm=N(p + "attn_norm.weight"), wq=wq, wk=wk, wv=wv, wo=Lin(p + "attn_output"),
                q_norm=N(p + "attn_q_norm.weight"), k_norm=N(p + "attn_k_norm.weight"),
                ffn_norm=N(p + "ffn_norm.weight"), ffn_gate=Lin(p + "ffn_gate"),
                ffn_up=Lin(p + "ffn_up"), ffn_down=Lin(p + "ffn_down"),
            )
            if hp.arch == "gemma3":
                layer.attn_post_norm = N(p + "post_attention_norm.weight")
                layer.ffn_post_norm = N(p + "post_ffw_norm.weight")
            if tuple(layer.wq.w.shape) != (q_rows, hp.n_embd) or tuple(layer.wk.w.shape) != (kv_rows, hp.n_embd):
                raise PaskError(f"{g.path.name}: layer {il} attention shapes do not match the hyperparameters")
            layers.append(layer)

        tok_embd = W("token_embd.weight")
        if g.has_tensor("output.weight"):
            output = Lin("output")
        else:   # tied embeddings
            output = _Linear(tok_embd, None, gn.act_format(g.tensor_type("token_embd.weight")))
        return cls(hp, tok_embd, output, N("output_norm.weight"), layers, dtype, dev, numerics, str(path))

    # --- properties -------------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        return self.hparams.n_layer

    @property
    def arch(self) -> str:
        return self.hparams.arch

    @property
    def n_vocab(self) -> int:
        return self.hparams.n_vocab

    @property
    def attn_out_dim(self) -> int:
        return self.hparams.n_head * self.hparams.head_dim

    def is_swa(self, layer: int) -> bool:
        """Whether ``layer`` is a sliding-window layer (Gemma 3 local layers)."""
        return self.hparams.is_swa(layer)

    # --- pieces -----------------------------------------------------------------------------
    def _mm(self, x: torch.Tensor, lin: _Linear) -> torch.Tensor:
        if self.numerics is not None and self.numerics.act_quant:
            x = gn.round_activation(x, lin.act)
        y = (x.to(self.dtype) @ lin.w.T).float()
        return y + lin.b if lin.b is not None else y

    def _gelu(self, x: torch.Tensor) -> torch.Tensor:
        if self.numerics is not None and self.numerics.gelu_table:
            return gn.gelu_tanh_table(x)
        return F.gelu(x, approximate="tanh")

    def _rope(self, x: torch.Tensor, pos: torch.Tensor, base: float, freq_scale: float) -> torch.Tensor:
        """NEOX-style rotation of the first n_rot dims of x [T, H, D] (pairs i, i + n_rot/2)."""
        n_rot = self.hparams.n_rot
        half = n_rot // 2
        inv = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / n_rot)
        ang = (pos.to(torch.float64)[:, None] * freq_scale) * inv[None, :]          # [T, half]
        cos = ang.cos().float()[:, None, :]
        sin = ang.sin().float()[:, None, :]
        x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)

    def _allowed(self, pos: torch.Tensor, layer: int, user: torch.Tensor | None) -> torch.Tensor:
        """[T, T] bool: causality AND the sliding window (SWA layers) AND the caller's mask."""
        d = pos[:, None] - pos[None, :]            # query_pos - key_pos
        allowed = d >= 0
        if self.is_swa(layer):
            allowed = allowed & (d < self.hparams.n_swa)
        if user is not None:
            allowed = allowed & user
        return allowed

    def _check_inputs(self, token_ids: torch.Tensor, attn_mask: torch.Tensor | None,
                      positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        if not isinstance(token_ids, torch.Tensor):
            token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        if token_ids.dim() != 1 or token_ids.numel() == 0:
            raise ReferenceInputError(f"token_ids must be a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}")
        token_ids = token_ids.to(self.device, torch.long)
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < 0 or hi >= self.n_vocab:
            raise ReferenceInputError(f"token id out of range [0, {self.n_vocab}): min {lo}, max {hi}")
        T = token_ids.numel()
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool:
                raise ReferenceInputError(f"attn_mask must be a bool tensor, got {attn_mask.dtype}")
            if attn_mask.dim() == 2:
                attn_mask = attn_mask.unsqueeze(0).expand(self.n_layer, T, T)
            if tuple(attn_mask.shape) != (self.n_layer, T, T):
                raise ReferenceInputError(
                    f"attn_mask must have shape [n_layer={self.n_layer}, T={T}, T={T}], got {tuple(attn_mask.shape)}")
            attn_mask = attn_mask.to(self.device)
        if positions is None:
            positions = torch.arange(T, device=self.device)
        else:
            positions = torch.as_tensor(positions, dtype=torch.long).to(self.device)
            if tuple(positions.shape) != (T,):
                raise ReferenceInputError(f"positions must have shape [{T}], got {tuple(positions.shape)}")
            if int(positions.min()) < 0:
                raise ReferenceInputError("positions must be >= 0")
        return token_ids, attn_mask, positions

    # --- forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, attn_mask: torch.Tensor | None = None,
                return_attn_outputs: bool = False, *, positions: torch.Tensor | None = None,
                logits_rows: torch.Tensor | slice | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [T, n_vocab] (float32) for every position of ``token_ids`` [T].

        attn_mask: bool [n_layer, T, T] (or [T, T] for all layers); [l, i, j] = query i may attend
        key j in layer l. Combined with causality and the sliding window.
        return_attn_outputs: also return the per-layer attention outputs [n_layer, T, n_head*head_dim]
        (float32), taken BEFORE the output projection ``attn_output`` (i.e. softmax(QK^T)V per head,
        heads concatenated), which is where evicting keys acts.
        positions: RoPE/window positions of the tokens (default 0..T-1); must be what llama.cpp got.
        logits_rows: only compute logits for these rows (index tensor or slice); saves the
        [T, n_vocab] matmul for big vocabularies. The returned tensor then has those rows only.
        """
        hp = self.hparams
        ids, mask, pos = self._check_inputs(token_ids, attn_mask, positions)
        T = ids.numel()
        x = self._tok_embd[ids].float()
        if hp.embd_scale != 1.0:
            x = x * hp.embd_scale
        H, KV, D = hp.n_head, hp.n_head_kv, hp.head_dim
        group = H // KV
        attn_outs: list[torch.Tensor] = []
        for il, L in enumerate(self._layers):
            h = _rms_norm(x, L.attn_norm, hp.rms_eps)
            q = self._mm(h, L.wq).view(T, H, D)
            k = self._mm(h, L.wk).view(T, KV, D)
            v = self._mm(h, L.wv).view(T, KV, D)
            q = _rms_norm(q, L.q_norm, hp.rms_eps)
            k = _rms_norm(k, L.k_norm, hp.rms_eps)
            if self.is_swa(il):
                base, fscale = hp.rope_base_swa, 1.0
            else:
                base, fscale = hp.rope_base, hp.rope_freq_scale
            q = self._rope(q, pos, base, fscale)
            k = self._rope(k, pos, base, fscale)
            # [H, T, D] x [H, D, T]; query head h reads kv head h // group (ggml broadcast order)
            # gemma3 scales Q before K^T Q (kq_scale 1), qwen3 scales the scores (soft_max_ext)
            pre_scale = hp.arch == "gemma3"
            if pre_scale:
                q = q * hp.attn_scale
            kv16 = self.numerics is not None and self.numerics.kv_f16
            if kv16:
                q, k, v = gn.f16(q), gn.f16(k), gn.f16(v)
            qh = q.permute(1, 0, 2)
            kh = k.permute(1, 0, 2).repeat_interleave(group, dim=0)
            vh = v.permute(1, 0, 2).repeat_interleave(group, dim=0)
            scores = qh @ kh.transpose(1, 2)
            if not pre_scale:
                scores = scores * hp.attn_scale
            allowed = self._allowed(pos, il, None if mask is None else mask[il])
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            probs = torch.nan_to_num(probs, nan=0.0)      # rows without any allowed key
            if kv16:
                probs = gn.f16(probs)
            o = (probs @ vh).permute(1, 0, 2).reshape(T, H * D)
            if return_attn_outputs:
                attn_outs.append(o)
            a = self._mm(o, L.wo)
            if L.attn_post_norm is not None:
                a = _rms_norm(a, L.attn_post_norm, hp.rms_eps)
            x = x + a
            h = _rms_norm(x, L.ffn_norm, hp.rms_eps)
            gate = self._mm(h, L.ffn_gate)
            up = self._mm(h, L.ffn_up)
            act = self._gelu(gate) if hp.arch == "gemma3" else F.silu(gate)
            f = self._mm(act * up, L.ffn_down)
            if L.ffn_post_norm is not None:
                f = _rms_norm(f, L.ffn_post_norm, hp.rms_eps)
            x = x + f
        if logits_rows is not None:
            x = x[logits_rows]
        out = _rms_norm(x, self._output_norm, hp.rms_eps)
        logits = self._mm(out, self._output)
        if hp.final_logit_softcap:
            c = hp.final_logit_softcap
            logits = torch.tanh(logits / c) * c
        if return_attn_outputs:
            return logits, torch.stack(attn_outs)
        return logits

    __call__ = forward

    def __repr__(self) -> str:
        hp = self.hparams
        return (f"ReferenceModel({hp.arch}, n_layer={hp.n_layer}, n_embd={hp.n_embd}, "
                f"n_vocab={hp.n_vocab}, dtype={self.dtype}, device={self.device})")


def log_softmax_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Per-row KL(P || Q) between two logit tensors [T, V] (float64 for stability)."""
    lp = torch.log_softmax(p_logits.double(), dim=-1)
    lq = torch.log_softmax(q_logits.double(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1)
