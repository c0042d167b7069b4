"""Write small random-weight Qwen3 / Gemma 3 GGUF files that llama.cpp loads.

Used by tests and benchmarks as fast, fully known models (never as a measure of model accuracy).
The tokenizer is a minimal SentencePiece-style ("llama") vocab: <unk>, <s>, </s>, the 256 byte
tokens <0x00>..<0xFF> (so any text tokenizes by byte fallback), then filler pieces up to n_vocab.
Weights are Gaussian with 1/sqrt(fan_in) scaling so activations stay O(1); QK-norm weights are
around 2 so attention is peaked enough that masking a key visibly changes outputs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pask_local.errors import PaskError

_SPECIALS = ("<unk>", "<s>", "</s>")
_N_BASE_TOKENS = len(_SPECIALS) + 256

_DEFAULTS: dict[str, dict[str, object]] = {
    "qwen3": dict(n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, n_vocab=320, n_ctx=512,
                  rope_base=1_000_000.0, rms_eps=1e-6, tie_embeddings=False),
    "gemma3": dict(n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, n_vocab=320, n_ctx=512,
                   rope_base=1_000_000.0, rope_base_swa=10_000.0, rms_eps=1e-6, sliding_window=8,
                   swa_pattern=2, final_logit_softcapping=0.0, tie_embeddings=True),
}


# dtype -> (GGUF type name of the matrices, llama.cpp file type name)
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
    n_ctx, rope_base, rms_eps, tie_embeddings; gemma3 also rope_base_swa, sliding_window,
    swa_pattern (int period as in llama.cpp, or a per-layer bool list), final_logit_softcapping
    (0: none). chat_template / control_tokens: a jinja chat template for the GGUF metadata and the
    control tokens it uses (added to the vocab after the byte tokens). dtype: the matrices' type, "f32", "f16", "bf16", "q8_0", "q5_0" or "q4_0" (quantized with
    gguf's own quantizers); norm weights stay f32, as llama.cpp's converter does.
    """
    import gguf

    if arch not in _DEFAULTS:
        raise SyntheticModelError(f"unknown synthetic arch {arch!r} (qwen3 or gemma3)")
    if dtype not in _MATRIX_TYPES:
        raise SyntheticModelError(f"unknown synthetic dtype {dtype!r} ({', '.join(_MATRIX_TYPES)})")
    unknown = set(dims) - set(_DEFAULTS[arch])
    if unknown:
        raise SyntheticModelError(f"unknown dims for {arch}: {', '.join(sorted(unknown))}")
    if n_layer < 1:
        raise SyntheticModelError("n_layer must be >= 1")
    d = {**_DEFAULTS[arch], **dims}
    n_embd, n_head, n_head_kv = int(d["n_embd"]), int(d["n_head"]), int(d["n_head_kv"])
    head_dim, n_ff, n_vocab = int(d["head_dim"]), int(d["n_ff"]), int(d["n_vocab"])
    if n_head % n_head_kv:
        raise SyntheticModelError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
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

    tokens, scores, types = _tokenizer(n_vocab, tuple(control_tokens))
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

    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    # Gemma multiplies embeddings by sqrt(n_embd): keep its raw table small so the scaled input is O(1).
    embd_gain = 1.0 if arch == "gemma3" else float(np.sqrt(n_embd))
    add_matrix("token_embd.weight", mat(n_vocab, n_embd, embd_gain))
    w.add_tensor("output_norm.weight", norm(n_embd))
    if not d["tie_embeddings"]:
        add_matrix("output.weight", mat(n_vocab, n_embd, 2.0))
    for il in range(n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm(n_embd))
        add_matrix(p + "attn_q.weight", mat(q_dim, n_embd))
        add_matrix(p + "attn_k.weight", mat(kv_dim, n_embd))
        add_matrix(p + "attn_v.weight", mat(kv_dim, n_embd))
        w.add_tensor(p + "attn_q_norm.weight", norm(head_dim, 2.0, 0.3))
        w.add_tensor(p + "attn_k_norm.weight", norm(head_dim, 2.0, 0.3))
        add_matrix(p + "attn_output.weight", mat(n_embd, q_dim))
        w.add_tensor(p + "ffn_norm.weight", norm(n_embd))
        add_matrix(p + "ffn_gate.weight", mat(n_ff, n_embd))
        add_matrix(p + "ffn_up.weight", mat(n_ff, n_embd))
        add_matrix(p + "ffn_down.weight", mat(n_embd, n_ff))
        if arch == "gemma3":
            w.add_tensor(p + "post_attention_norm.weight", norm(n_embd))
            w.add_tensor(p + "post_ffw_norm.weight", norm(n_embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
