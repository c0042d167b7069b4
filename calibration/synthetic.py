"""Write small random-weight GGUF files that llama.cpp loads: qwen3, gemma3, llama, qwen2, phi3,
mistral3 (attention models) and mamba (a recurrent model, to test refusals).

Used by tests and benchmarks as fast, fully known models (never as a measure of model accuracy).
The tokenizer is a minimal SentencePiece-style ("llama") vocab: <unk>, <s>, </s>, the 256 byte
tokens <0x00>..<0xFF> (so any text tokenizes by byte fallback), then filler pieces up to n_vocab.
Weights are Gaussian with 1/sqrt(fan_in) scaling so activations stay O(1); QK-norm weights are
around 2 (archs without QK-norm: Q and K projections with gain 2) so attention is peaked enough that
masking a key visibly changes outputs. Per-arch tensor layouts follow llama.cpp's loaders: qwen2 has
Q/K/V biases, phi3 a fused ``attn_qkv`` and a fused ``ffn_up`` holding [gate; up] (no ffn_gate).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pask_local.errors import PaskError

_SPECIALS = ("<unk>", "<s>", "</s>")
_N_BASE_TOKENS = len(_SPECIALS) + 256

_DENSE = dict(n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, n_vocab=320, n_ctx=512,
              rope_base=1_000_000.0, rms_eps=1e-6, tie_embeddings=False)
_DEFAULTS: dict[str, dict[str, object]] = {
    "qwen3": dict(_DENSE),
    "llama": dict(_DENSE, rope_base=500_000.0, rms_eps=1e-5),
    "mistral3": dict(_DENSE, rope_base=1_000_000.0, rms_eps=1e-5),
    "qwen2": dict(_DENSE, rope_base=1_000_000.0, tie_embeddings=True),
    "phi3": dict(_DENSE, n_head_kv=4, rope_base=10_000.0, rms_eps=1e-5),
    "mamba": dict(n_embd=64, n_vocab=320, n_ctx=512, rms_eps=1e-5, d_state=8, d_conv=4, dt_rank=4),
    "gemma3": dict(n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, n_vocab=320, n_ctx=512,
                   rope_base=1_000_000.0, rope_base_swa=10_000.0, rms_eps=1e-6, sliding_window=8,
                   swa_pattern=2, final_logit_softcapping=0.0, tie_embeddings=True),
}


# dtype -> (GGUF type name of the matrices, llama.cpp file type name)
#: architectures with per-head RMSNorm of Q and K; with Q/K/V biases; with fused QKV + gate_up
_QK_NORM = ("qwen3", "gemma3")
_QKV_BIAS = ("qwen2",)
_FUSED = ("phi3",)
#: archs whose attention output dim must equal n_embd in llama.cpp's loader (wo is {n_embd, n_embd})
_SQUARE_ATTN = ("qwen2", "phi3")
#: the attention architectures; "mamba" is recurrent (no KV cache)
ATTENTION_ARCHS = ("qwen3", "gemma3", "llama", "qwen2", "phi3", "mistral3")

_MATRIX_TYPES = {
    "f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"), "q5_0": ("Q5_0", "MOSTLY_Q5_0"), "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}


class SyntheticModelError(PaskError):
    """Bad parameters for a synthetic GGUF."""


def _tokenizer(n_vocab: int, control: tuple[str, ...] = ()) -> tuple[list[str], list[float], list[int]]:
    import gguf

    tokens = list(_SPECIALS) + [f"<0x{b:02X}>" for b in range(256)] + list(control)
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
             + [gguf.TokenType.CONTROL] * len(control))
    letters = "abcdefghijklmnopqrstuvwxyz"
    extra = n_vocab - len(tokens)
    # filler pieces: "▁" (the SPM space), "▁a".."▁z", then two-letter pieces; all NORMAL tokens with decreasing scores
    fill = ["\u2581"] + ["\u2581" + c for c in letters] + [a + b for a in letters for b in letters]
    if extra > len(fill):
        fill += [f"\u2581w{i}" for i in range(extra - len(fill))]
    tokens += fill[:extra]
    types += [gguf.TokenType.NORMAL] * extra
    scores = [0.0] * (_N_BASE_TOKENS + len(control)) + [-float(i + 1) for i in range(extra)]
    return tokens, scores, [int(t) for t in types]


def write_synthetic_gguf(path: str | os.PathLike[str], arch: str = "qwen3", n_layer: int = 4,
                         dtype: str = "f32", seed: int = 0, chat_template: str | None = None,
                         control_tokens: tuple[str, ...] = (), **dims: object) -> Path:
    """Write a random-weight ``arch`` GGUF at ``path`` and return its Path.

    dims (defaults per arch in ``_DEFAULTS``): n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab,
    n_ctx, rope_base, rms_eps, tie_embeddings (mamba: n_embd, n_vocab, n_ctx, rms_eps, d_state,
    d_conv, dt_rank); qwen2 and phi3 need n_head * head_dim == n_embd; gemma3 also rope_base_swa, sliding_window,
    swa_pattern (int period as in llama.cpp, or a per-layer bool list), final_logit_softcapping
    (0: none). chat_template / control_tokens: a jinja chat template for the GGUF metadata and the
    control tokens it uses (added to the vocab after the byte tokens). dtype: the matrices' type, "f32", "f16", "bf16", "q8_0", "q5_0" or "q4_0" (quantized with
    gguf's own quantizers); norm weights stay f32, as llama.cpp's converter does.
    """
    import gguf

    if arch not in _DEFAULTS:
        raise SyntheticModelError(f"unknown synthetic arch {arch!r} ({', '.join(_DEFAULTS)})")
    if dtype not in _MATRIX_TYPES:
        raise SyntheticModelError(f"unknown synthetic dtype {dtype!r} ({', '.join(_MATRIX_TYPES)})")
    unknown = set(dims) - set(_DEFAULTS[arch])
    if unknown:
        raise SyntheticModelError(f"unknown dims for {arch}: {', '.join(sorted(unknown))}")
    if n_layer < 1:
        raise SyntheticModelError("n_layer must be >= 1")
    d = {**_DEFAULTS[arch], **dims}
    if arch == "mamba":
        return _write_mamba(Path(path), n_layer, seed, d)
    if arch == "phi3" and "<|endoftext|>" not in control_tokens:
        # llama.cpp's vocab loader looks this token up for models named phi3 (as real Phi-3 vocabs have it)
        control_tokens = (*control_tokens, "<|endoftext|>")
    n_embd, n_head, n_head_kv = int(d["n_embd"]), int(d["n_head"]), int(d["n_head_kv"])
    head_dim, n_ff, n_vocab = int(d["head_dim"]), int(d["n_ff"]), int(d["n_vocab"])
    if n_head % n_head_kv:
        raise SyntheticModelError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    if arch in _SQUARE_ATTN and n_head * head_dim != n_embd:
        raise SyntheticModelError(f"{arch} needs n_head * head_dim == n_embd ({n_head} * {head_dim} != {n_embd})")
    if n_vocab < _N_BASE_TOKENS + len(control_tokens):
        raise SyntheticModelError(f"n_vocab must be >= {_N_BASE_TOKENS + len(control_tokens)} "
                                  "(specials + 256 byte tokens + control tokens)")

    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[_MATRIX_TYPES[dtype][0]]
    if qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if any(n % block for n in (n_embd, n_ff, n_head * head_dim)):
            raise SyntheticModelError(f"{dtype} needs n_embd, n_ff and n_head*head_dim divisible by {block}")

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        # numpy [rows=out, cols=in] == GGUF ne {in, out}, the layout llama.cpp expects
        return (rng.standard_normal((rows, cols)) * (gain / np.sqrt(cols))).astype(np.float32)

    def norm(n: int, center: float = 1.0, spread: float = 0.1) -> np.ndarray:
        return (center + spread * rng.standard_normal(n)).astype(np.float32)

    path = Path(path)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"synthetic-{arch}-{n_layer}l-{dtype}-s{seed}")
    w.add_block_count(n_layer)
    w.add_context_length(int(d["n_ctx"]))
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(float(d["rms_eps"]))
    w.add_rope_freq_base(float(d["rope_base"]))
    w.add_file_type(gguf.LlamaFileType[_MATRIX_TYPES[dtype][1]])

    def add_matrix(name: str, arr: np.ndarray) -> None:
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    if arch == "gemma3":
        if int(d["sliding_window"]) > 0:
            w.add_sliding_window(int(d["sliding_window"]))
            pattern = d["swa_pattern"]
            if isinstance(pattern, Sequence):
                if len(pattern) != n_layer:
                    raise SyntheticModelError(f"swa_pattern has {len(pattern)} entries for {n_layer} layers")
                w.add_sliding_window_pattern([bool(p) for p in pattern])
            else:
                w.add_sliding_window_pattern(int(pattern))  # type: ignore[arg-type]
            w.add_rope_freq_base_swa(float(d["rope_base_swa"]))
        if float(d["final_logit_softcapping"]) > 0:
            w.add_final_logit_softcapping(float(d["final_logit_softcapping"]))

    _add_tokenizer(w, n_vocab, tuple(control_tokens), chat_template)

    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    qk_gain = 1.0 if arch in _QK_NORM else 2.0
    # Gemma multiplies embeddings by sqrt(n_embd): keep its raw table small so the scaled input is O(1).
    embd_gain = 1.0 if arch == "gemma3" else float(np.sqrt(n_embd))
    add_matrix("token_embd.weight", mat(n_vocab, n_embd, embd_gain))
    w.add_tensor("output_norm.weight", norm(n_embd))
    if not d["tie_embeddings"]:
        add_matrix("output.weight", mat(n_vocab, n_embd, 2.0))
    for il in range(n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm(n_embd))
        wq, wk, wv = mat(q_dim, n_embd, qk_gain), mat(kv_dim, n_embd, qk_gain), mat(kv_dim, n_embd)
        if arch in _FUSED:
            add_matrix(p + "attn_qkv.weight", np.concatenate([wq, wk, wv]))
        else:
            add_matrix(p + "attn_q.weight", wq)
            add_matrix(p + "attn_k.weight", wk)
            add_matrix(p + "attn_v.weight", wv)
        if arch in _QKV_BIAS:
            for name, n in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                w.add_tensor(p + name + ".bias", (0.5 * rng.standard_normal(n)).astype(np.float32))
        if arch in _QK_NORM:
            w.add_tensor(p + "attn_q_norm.weight", norm(head_dim, 2.0, 0.3))
            w.add_tensor(p + "attn_k_norm.weight", norm(head_dim, 2.0, 0.3))
        add_matrix(p + "attn_output.weight", mat(n_embd, q_dim))
        w.add_tensor(p + "ffn_norm.weight", norm(n_embd))
        if arch in _FUSED:
            add_matrix(p + "ffn_up.weight", np.concatenate([mat(n_ff, n_embd), mat(n_ff, n_embd)]))
        else:
            add_matrix(p + "ffn_gate.weight", mat(n_ff, n_embd))
            add_matrix(p + "ffn_up.weight", mat(n_ff, n_embd))
        add_matrix(p + "ffn_down.weight", mat(n_embd, n_ff))
        if arch == "gemma3":
            w.add_tensor(p + "post_attention_norm.weight", norm(n_embd))
            w.add_tensor(p + "post_ffw_norm.weight", norm(n_embd))
    return _finish(w, path)


def _add_tokenizer(w, n_vocab: int, control_tokens: tuple[str, ...], chat_template: str | None) -> None:
    tokens, scores, types = _tokenizer(n_vocab, control_tokens)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def _finish(w, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write_mamba(path: Path, n_layer: int, seed: int, d: dict[str, object]) -> Path:
    """A Mamba (v1) GGUF: recurrent, no attention and no KV cache (llama.cpp's mamba loader layout)."""
    import gguf

    rng = np.random.default_rng(seed)
    n_embd, n_vocab = int(d["n_embd"]), int(d["n_vocab"])
    d_inner, d_state, d_conv, dt_rank = 2 * n_embd, int(d["d_state"]), int(d["d_conv"]), int(d["dt_rank"])
    if n_vocab < _N_BASE_TOKENS:
        raise SyntheticModelError(f"n_vocab must be >= {_N_BASE_TOKENS}")

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    w = gguf.GGUFWriter(path, "mamba")
    w.add_name(f"synthetic-mamba-{n_layer}l-s{seed}")
    w.add_block_count(n_layer)
    w.add_context_length(int(d["n_ctx"]))
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(float(d["rms_eps"]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(w, n_vocab, (), None)
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd) * np.float32(np.sqrt(n_embd)))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    for il in range(n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ssm_in.weight", mat(2 * d_inner, n_embd))
        w.add_tensor(p + "ssm_conv1d.weight", mat(d_inner, d_conv))
        w.add_tensor(p + "ssm_conv1d.bias", np.zeros(d_inner, dtype=np.float32))
        w.add_tensor(p + "ssm_x.weight", mat(dt_rank + 2 * d_state, d_inner))
        w.add_tensor(p + "ssm_dt.weight", mat(d_inner, dt_rank))
        w.add_tensor(p + "ssm_dt.bias", np.zeros(d_inner, dtype=np.float32))
        w.add_tensor(p + "ssm_a", -np.exp(rng.standard_normal((d_inner, d_state))).astype(np.float32))
        w.add_tensor(p + "ssm_d", np.ones(d_inner, dtype=np.float32))
        w.add_tensor(p + "ssm_out.weight", mat(n_embd, d_inner))
    return _finish(w, path)
