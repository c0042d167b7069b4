"""A plain-torch reference forward of Qwen3 / Gemma 3 / Qwen2 / Llama / Mistral3 / Phi-3 GGUF models
with per-layer attention masks.

It is the oracle that llama.cpp (stock and pask-patched) is checked against, and the model the
calibration signals are measured on. It follows llama.cpp's graphs (src/models/qwen3.cpp,
src/models/gemma3.cpp) with the weights exactly as stored in the GGUF:

- Qwen3: RMSNorm, QK-RMSNorm, NEOX RoPE (GGUF base), GQA, SwiGLU FFN, scale 1/sqrt(head_dim).
- Qwen2: as Qwen3 without QK-norm, with Q/K/V biases (and an optional output bias).
- Llama / Mistral3: as Qwen2 without biases (optional ones are used if present), NORM RoPE (adjacent
  pairs rotated), scale ``attention.scale`` or 1/sqrt(head_dim).
- Phi-3: fused QKV and fused gate_up (``ffn_up`` holds [gate; up]), NEOX RoPE, Q scaled by
  1/sqrt(head_dim) before K^T Q.
- Gemma 3: embeddings * sqrt(n_embd); RMSNorm weights used as stored (the converter already
  folded Gemma's ``1 + w``); pre/post attention and FFN norms; QK-norm; GELU(tanh)-gated FFN;
  attention scale 1/sqrt(key_length) (27B: 1/sqrt(n_embd/n_head)); sliding-window layers (window
  and SWA/global pattern from the GGUF, llama.cpp's default pattern 6) with their own RoPE base
  (``rope.freq_base_swa``, default 10000); optional final logit soft-capping.

Masks: ``attn_mask[l, i, j]`` = query i may attend key j in layer l. It is ANDed with causality
(key position <= query position) and, in SWA layers, the window (query_pos - key_pos < n_swa), as in
llama.cpp's ``is_masked_swa``. A query row left with no key gets a zero attention output.

Restarts: ``trace`` runs the unmasked forward once and keeps the residual stream entering every
layer plus every layer's keys/values; ``forward_from(layer, trace, mask, start_row=r)`` then
recomputes only layers >= ``layer`` and rows >= ``r`` of a masked forward (what calibration needs
when it evicts tokens in one layer group: earlier layers and earlier rows are unchanged).

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
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    ffn_gate: _Linear
    ffn_up: _Linear
    ffn_down: _Linear
    attn_post_norm: torch.Tensor | None = None   # gemma3
    ffn_post_norm: torch.Tensor | None = None    # gemma3


@dataclass
class ForwardTrace:
    """What an unmasked forward leaves for masked restarts (``ReferenceModel.forward_from``)."""

    ids: torch.Tensor                 # [T] token ids
    positions: torch.Tensor           # [T]
    hidden: list[torch.Tensor]        # per layer: the residual stream entering it [T, n_embd]
    k: list[torch.Tensor]             # per layer: keys [T, n_head_kv, head_dim] (post norm/RoPE)
    v: list[torch.Tensor]             # per layer: values [T, n_head_kv, head_dim]
    attn: list[torch.Tensor]          # per layer: attention outputs [T, n_head*head_dim]
    logits: torch.Tensor              # logits of the rows asked for


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """llama.cpp's ggml_rms_norm followed by a multiply with the stored weight, in ggml-cpu's
    order of roundings: float32 squares summed in double, mean rounded to float32,
    scale = 1/sqrtf(mean + eps), y = (x * scale) * w."""
    x = x.float()
    mean = ((x * x).double().sum(-1, keepdim=True) / x.shape[-1]).float()
    # float32 torch.sqrt is not always correctly rounded on CPU (vectorized approximation); sqrtf is
    scale = torch.ones_like(mean) / torch.sqrt((mean + eps).double()).float()
    return (x * scale) * w.float()


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

        def N_opt(name: str) -> torch.Tensor | None:
            return N(name) if g.has_tensor(name) else None

        def ffn(p: str) -> tuple[_Linear, _Linear]:
            if g.has_tensor(p + "ffn_gate.weight"):
                return Lin(p + "ffn_gate"), Lin(p + "ffn_up")
            fused = Lin(p + "ffn_up")           # phi3: ffn_up holds [gate; up]
            if fused.w.shape[0] != 2 * hp.n_ff:
                raise PaskError(f"{g.path.name}: {p}ffn_up has {fused.w.shape[0]} rows; a fused gate_up needs "
                                f"{2 * hp.n_ff}")
            wg, wu = torch.split(fused.w, [hp.n_ff, hp.n_ff], dim=0)
            bg, bu = torch.split(fused.b, [hp.n_ff, hp.n_ff]) if fused.b is not None else (None, None)
            return _Linear(wg, bg, fused.act), _Linear(wu, bu, fused.act)

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
            gate, up = ffn(p)
            qk_norm = hp.arch in ("qwen3", "gemma3")
            layer = _Layer(
                attn_norm=N(p + "attn_norm.weight"), wq=wq, wk=wk, wv=wv, wo=Lin(p + "attn_output"),
                q_norm=N(p + "attn_q_norm.weight") if qk_norm else N_opt(p + "attn_q_norm.weight"),
                k_norm=N(p + "attn_k_norm.weight") if qk_norm else N_opt(p + "attn_k_norm.weight"),
                ffn_norm=N(p + "ffn_norm.weight"), ffn_gate=gate, ffn_up=up, ffn_down=Lin(p + "ffn_down"),
            )
            if not qk_norm and (layer.q_norm is not None or layer.k_norm is not None):
                raise PaskError(f"{g.path.name}: {hp.arch} with QK-norm tensors is not supported by the reference")
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

    def _allowed(self, pos: torch.Tensor, layer: int, user: torch.Tensor | None, start: int = 0) -> torch.Tensor:
        """[T-start, T] bool for query rows start..T-1: causality AND the sliding window (SWA
        layers) AND the caller's mask (already restricted to those rows)."""
        d = pos[start:, None] - pos[None, :]            # query_pos - key_pos
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
    def _rope_tables(self, pos: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin [T, 1, n_rot/2] for global (False) and sliding-window (True) layers at ``pos``."""
        hp = self.hparams
        half = hp.n_rot // 2
        out = {}
        for swa, (base, fscale) in ((False, (hp.rope_base, hp.rope_freq_scale)), (True, (hp.rope_base_swa, 1.0))):
            if self.numerics is not None and self.numerics.rope_cache:
                ang = gn.rope_angles(pos, base, fscale, hp.n_rot)
            else:
                inv = base ** (-torch.arange(half, dtype=torch.float64, device=pos.device) * 2.0 / hp.n_rot)
                ang = (pos.to(torch.float64)[:, None] * fscale) * inv[None, :]          # [T, half]
            out[swa] = (ang.cos().float()[:, None, :], ang.sin().float()[:, None, :])
        return out

    def _rotate(self, x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE of the first n_rot dims of x [T, H, D]: NEOX pairs (i, i + n_rot/2) or, for
        llama-style (NORM) archs, adjacent pairs (2i, 2i + 1); pair i turns by angle i either way."""
        n_rot = self.hparams.n_rot
        half = n_rot // 2
        cos, sin = table
        if not self.hparams.rope_neox:
            x1, x2, rest = x[..., 0:n_rot:2], x[..., 1:n_rot:2], x[..., n_rot:]
            rot = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
            return torch.cat([rot, rest], dim=-1)
        x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)

    def _layer(self, il: int, x: torch.Tensor, pos: torch.Tensor, start: int, user: torch.Tensor | None,
               rope: dict[bool, tuple[torch.Tensor, torch.Tensor]], k_prefix: torch.Tensor | None,
               v_prefix: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One block on the rows ``start..T-1`` (``x`` [T-start, n_embd]); keys/values of rows
        ``0..start-1`` come from ``k_prefix``/``v_prefix``. Returns (x, attention output, k, v) with
        k, v [T, n_head_kv, head_dim] for all rows (post norm/RoPE, as the KV cache holds them)."""
        hp = self.hparams
        L = self._layers[il]
        n = x.shape[0]
        H, KV, D = hp.n_head, hp.n_head_kv, hp.head_dim
        group = H // KV
        swa = self.is_swa(il)
        rq = (rope[swa][0][start:], rope[swa][1][start:])
        h = _rms_norm(x, L.attn_norm, hp.rms_eps)
        q = self._mm(h, L.wq).view(n, H, D)
        k = self._mm(h, L.wk).view(n, KV, D)
        v = self._mm(h, L.wv).view(n, KV, D)
        if L.q_norm is not None:
            q = _rms_norm(q, L.q_norm, hp.rms_eps)
        if L.k_norm is not None:
            k = _rms_norm(k, L.k_norm, hp.rms_eps)
        q = self._rotate(q, rq)
        k = self._rotate(k, rq)
        # [H, T, D] x [H, D, T]; query head h reads kv head h // group (ggml broadcast order)
        # gemma3 / phi3 scale Q before K^T Q (kq_scale 1), the others scale the scores (soft_max_ext)
        pre_scale = hp.pre_scale_q
        if pre_scale:
            q = q * hp.attn_scale
        kv16 = self.numerics is not None and self.numerics.kv_f16
        if kv16:
            q, k, v = gn.f16(q), gn.f16(k), gn.f16(v)
        if start:
            assert k_prefix is not None and v_prefix is not None
            k = torch.cat([k_prefix[:start], k])
            v = torch.cat([v_prefix[:start], v])
        qh = q.permute(1, 0, 2)
        kh = k.permute(1, 0, 2).repeat_interleave(group, dim=0)
        vh = v.permute(1, 0, 2).repeat_interleave(group, dim=0)
        scores = qh @ kh.transpose(1, 2)
        if not pre_scale:
            scores = scores * hp.attn_scale
        allowed = self._allowed(pos, il, user, start)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)      # rows without any allowed key
        if kv16:
            probs = gn.f16(probs)
        o = (probs @ vh).permute(1, 0, 2).reshape(n, H * D)
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
        return x + f, o, k, v

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, output projection and soft-capping: logits (float32) of the rows of ``x``."""
        hp = self.hparams
        out = _rms_norm(x, self._output_norm, hp.rms_eps)
        logits = self._mm(out, self._output)
        if hp.final_logit_softcap:
            c = hp.final_logit_softcap
            logits = torch.tanh(logits / c) * c
        return logits

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self._tok_embd[ids].float()
        if self.hparams.embd_scale != 1.0:
            x = x * self.hparams.embd_scale
        return x

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
        ids, mask, pos = self._check_inputs(token_ids, attn_mask, positions)
        x = self._embed(ids)
        rope = self._rope_tables(pos)
        attn_outs: list[torch.Tensor] = []
        for il in range(self.n_layer):
            x, o, _, _ = self._layer(il, x, pos, 0, None if mask is None else mask[il], rope, None, None)
            if return_attn_outputs:
                attn_outs.append(o)
        if logits_rows is not None:
            x = x[logits_rows]
        logits = self._head(x)
        if return_attn_outputs:
            return logits, torch.stack(attn_outs)
        return logits

    @torch.inference_mode()
    def trace(self, token_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
              logits_rows: torch.Tensor | slice | None = None) -> ForwardTrace:
        """An unmasked forward that keeps what ``forward_from`` restarts from: the residual stream
        entering every layer, every layer's keys/values and attention outputs, and the logits of
        ``logits_rows`` (all rows by default)."""
        ids, _, pos = self._check_inputs(token_ids, None, positions)
        x = self._embed(ids)
        rope = self._rope_tables(pos)
        hidden, ks, vs, outs = [], [], [], []
        for il in range(self.n_layer):
            hidden.append(x)
            x, o, k, v = self._layer(il, x, pos, 0, None, rope, None, None)
            ks.append(k)
            vs.append(v)
            outs.append(o)
        logits = self._head(x if logits_rows is None else x[logits_rows])
        return ForwardTrace(ids=ids, positions=pos, hidden=hidden, k=ks, v=vs, attn=outs, logits=logits)

    @torch.inference_mode()
    def forward_from(self, layer: int, base: ForwardTrace, attn_mask: torch.Tensor | None = None, *,
                     start_row: int = 0, logits_rows: torch.Tensor | None = None,
                     return_attn_outputs: bool = False,
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The masked forward restarted at ``layer`` from an unmasked ``trace``: equal to
        ``forward(ids, attn_mask)`` provided the mask changes nothing before ``layer`` and nothing for
        rows before ``start_row`` (those rows' states, keys and values are taken from ``base``; the
        mask's rows < start_row are ignored). Only rows ``start_row..T-1`` are recomputed.

        logits_rows: absolute row indices (each >= start_row) to return logits for (default: all
        recomputed rows). return_attn_outputs: also the attention outputs of layers
        ``layer..n_layer-1`` for the recomputed rows, [n_layer - layer, T - start_row, n_head*head_dim].
        """
        T = base.ids.numel()
        if not 0 <= layer < self.n_layer:
            raise ReferenceInputError(f"layer must be in [0, {self.n_layer}), got {layer}")
        if not 0 <= start_row < T:
            raise ReferenceInputError(f"start_row must be in [0, {T}), got {start_row}")
        _, mask, pos = self._check_inputs(base.ids, attn_mask, base.positions)
        rope = self._rope_tables(pos)
        x = base.hidden[layer][start_row:]
        attn_outs: list[torch.Tensor] = []
        for il in range(layer, self.n_layer):
            user = None if mask is None else mask[il][start_row:]
            x, o, _, _ = self._layer(il, x, pos, start_row, user, rope, base.k[il], base.v[il])
            if return_attn_outputs:
                attn_outs.append(o)
        if logits_rows is not None:
            rows = torch.as_tensor(logits_rows, dtype=torch.long, device=x.device)
            if rows.numel() and int(rows.min()) < start_row:
                raise ReferenceInputError(f"logits_rows must be >= start_row ({start_row})")
            x = x[rows - start_row]
        logits = self._head(x)
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
