"""A thin, typed wrapper over llama.cpp's low-level C API (through ``llama_cpp.llama_cpp``).

``Model`` owns a loaded GGUF (vocab, tokenization, metadata); ``Context`` owns a llama_context and
decodes token batches at explicit positions/sequences, returning logits as numpy arrays. Every
other module (engine, tagging, tests, benchmarks) goes through these two classes instead of
touching ctypes directly. Errors surface as ``ModelError`` / ``NativeError`` with one-line messages.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ModelError, NativeError
from .models import check_gguf

if TYPE_CHECKING:
    from .rpc.placement import Placement

_BACKEND_READY = False


def _raw():
    try:
        import llama_cpp.llama_cpp as raw
    except Exception as exc:
        raise NativeError(f"cannot import llama_cpp ({exc}); run scripts/setup") from None
    return raw


def _init_backend(verbose: bool) -> None:
    global _BACKEND_READY
    raw = _raw()
    if not _BACKEND_READY:
        raw.llama_backend_init()
        _BACKEND_READY = True
    if not verbose:
        _silence_logs()


_LOG_CB = None


def _silence_logs() -> None:
    """Route llama.cpp's logging to nowhere (PASK_VERBOSE=1 keeps it)."""
    global _LOG_CB
    if os.environ.get("PASK_VERBOSE") or _LOG_CB is not None:
        return
    raw = _raw()

    @raw.llama_log_callback
    def _quiet(level, text, user_data):  # noqa: ARG001
        return None

    _LOG_CB = _quiet
    raw.llama_log_set(_LOG_CB, ctypes.c_void_p())


def default_threads() -> int:
    return int(os.environ.get("PASK_THREADS", "0")) or max(1, os.cpu_count() or 1)


def default_gpu_layers() -> int:
    """Layers offloaded when a caller does not say: ``PASK_NGL`` (e.g. 99 for all; scripts/gpu_check
    runs the native tests so), else 0. A value that is not an integer is a one-line ModelError."""
    text = os.environ.get("PASK_NGL", "0").strip() or "0"
    try:
        n = int(text)
    except ValueError:
        raise ModelError(f"PASK_NGL must be a number of layers, got {text!r}") from None
    if n < 0:
        raise ModelError(f"PASK_NGL must be at least 0, got {n}")
    return n


class Model:
    """A GGUF model loaded with llama.cpp (weights on CPU unless n_gpu_layers > 0; None: ``PASK_NGL``).

    ``placement`` (``rpc.Placement``) instead says which devices take the offloaded layers: RPC
    servers (``--rpc``) in ``--tensor-split`` proportions; it overrides ``n_gpu_layers``."""

    def __init__(self, path: str | os.PathLike[str], n_gpu_layers: int | None = None, verbose: bool = False,
                 placement: Placement | None = None) -> None:
        self.path = Path(path)
        if n_gpu_layers is None:
            n_gpu_layers = default_gpu_layers()
        check_gguf(self.path)  # a one-line ModelError before llama.cpp can abort on a bad file
        _init_backend(verbose)
        raw = _raw()
        params = raw.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        keep = placement.model_params(params) if placement is not None else []
        self.placement = placement
        self._ptr = raw.llama_model_load_from_file(str(self.path).encode(), params)
        del keep   # the device and split arrays: llama.cpp copied them during the load
        if not self._ptr:
            raise ModelError(f"llama.cpp could not load {self.path} (not a supported GGUF model?)")
        self.vocab = raw.llama_model_get_vocab(self._ptr)
        self.n_vocab: int = raw.llama_vocab_n_tokens(self.vocab)
        self.n_layer: int = raw.llama_model_n_layer(self._ptr)
        self.n_ctx_train: int = raw.llama_model_n_ctx_train(self._ptr)
        self.bos: int = raw.llama_vocab_bos(self.vocab)
        self.eos: int = raw.llama_vocab_eos(self.vocab)
        # the GGUF's tokenizer.ggml.add_bos_token (Qwen2.5: false, its BOS id is <|endoftext|>)
        self.add_bos: bool = bool(raw.llama_vocab_get_add_bos(self.vocab)) and self.bos >= 0
        self._pieces: dict[int, bytes] = {}
        self._longest_piece: int | None = None
        # contexts still open on this model: llama_model_free waits for the last one (a context's
        # destructor reads the model; in a garbage cycle the two finalizers run in any order)
        self._lock = threading.Lock()
        self._n_contexts = 0
        self._closing = False

    @property
    def ptr(self):
        return self._ptr

    def close(self) -> None:
        """Free the model now, or when its last open context closes."""
        if not getattr(self, "_ptr", None):
            return
        with self._lock:
            self._closing = True
            if self._n_contexts:
                return
            ptr, self._ptr = self._ptr, None
        _raw().llama_model_free(ptr)

    def _context_opened(self) -> None:
        with self._lock:
            self._n_contexts += 1

    def _context_closed(self) -> None:
        with self._lock:
            self._n_contexts -= 1
            if not (self._closing and self._n_contexts == 0 and self._ptr):
                return
            ptr, self._ptr = self._ptr, None
        _raw().llama_model_free(ptr)

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None."""
        raw = _raw()
        buf = ctypes.create_string_buffer(4096)
        n = raw.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    @property
    def arch(self) -> str:
        return self.meta("general.architecture") or "unknown"

    def chat_template(self) -> str | None:
        raw = _raw()
        tmpl = raw.llama_model_chat_template(self._ptr, None)
        return tmpl.decode("utf-8", "replace") if tmpl else None

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        raw = _raw()
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (raw.llama_token * cap)()
        n = raw.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (raw.llama_token * cap)()
            n = raw.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise NativeError("llama_tokenize failed")
        return list(buf[:n])

    def piece(self, token: int, special: bool = True) -> bytes:
        """The raw bytes of one token (may be a partial UTF-8 sequence)."""
        key = token if special else -1 - token
        got = self._pieces.get(key)
        if got is None:
            if not 0 <= token < self.n_vocab:  # llama.cpp throws a C++ exception: the process aborts
                raise NativeError(f"token id {token} is outside the vocabulary (0..{self.n_vocab - 1})")
            raw = _raw()
            buf = ctypes.create_string_buffer(64)
            n = raw.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = raw.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
            got = buf.raw[:n]
            self._pieces[key] = got
        return got

    def longest_piece(self) -> int:
        """Bytes of the vocabulary's longest non-special token: text of B bytes is at least
        B / longest_piece() tokens, whatever it holds (checked once; the pieces are not kept)."""
        if self._longest_piece is None:
            raw = _raw()
            buf = ctypes.create_string_buffer(256)
            longest = 1
            for token in range(self.n_vocab):
                n = raw.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
                longest = max(longest, n if n >= 0 else -n)
            self._longest_piece = longest
        return self._longest_piece

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(_raw().llama_vocab_is_eog(self.vocab, token))


@dataclass
class ContextConfig:
    n_ctx: int = 4096
    n_batch: int = 512
    n_seq_max: int = 1
    kv_unified: bool = False    # with n_seq_max > 1: one KV stream shared by all sequences (else one each)
    flash_attn: bool = False
    n_threads: int = 0          # 0: PASK_THREADS or all cores
    embeddings: bool = False
    type_k: int | None = None   # ggml_type of the K cache (None: llama.cpp's default, F16)
    type_v: int | None = None   # ggml_type of the V cache


class Context:
    """A llama_context over a Model; decodes token batches and exposes logits."""

    def __init__(self, model: Model, config: ContextConfig | None = None, ptr=None,
                 configure: Callable[[Any], None] | None = None) -> None:
        """Create a standard context, or adopt ``ptr`` created elsewhere (e.g. a layered-cache ctx).

        ``configure`` may edit the llama_context_params before creation (e.g. install an eval
        callback such as ``AttentionProbe.install``).
        """
        raw = _raw()
        self.model = model
        self.config = config or ContextConfig()
        if ptr is None:
            params = self.params()
            if configure is not None:
                configure(params)
            ptr = raw.llama_init_from_model(model.ptr, params)
        if not ptr:
            raise NativeError("llama.cpp could not create a context (out of memory or bad parameters)")
        self._ptr = ptr
        model._context_opened()
        self.n_ctx: int = raw.llama_n_ctx(ptr)
        self._batch = raw.llama_batch_init(max(1, self.config.n_batch), 0, max(1, self.config.n_seq_max))

    def params(self):
        """llama_context_params for this config (also used by native extensions)."""
        raw = _raw()
        cfg = self.config
        p = raw.llama_context_default_params()
        p.n_ctx = cfg.n_ctx
        p.n_batch = cfg.n_batch
        p.n_ubatch = cfg.n_batch
        p.n_seq_max = cfg.n_seq_max
        p.kv_unified = cfg.kv_unified
        threads = cfg.n_threads or default_threads()
        p.n_threads = threads
        p.n_threads_batch = threads
        p.embeddings = cfg.embeddings
        p.flash_attn_type = 1 if cfg.flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / DISABLED
        if cfg.type_k is not None:
            p.type_k = cfg.type_k
        if cfg.type_v is not None:
            p.type_v = cfg.type_v
        return p

    @property
    def ptr(self):
        return self._ptr

    @property
    def address(self) -> int:
        """The llama_context pointer as an int (for our ctypes bindings, whatever type ``ptr`` has)."""
        p = self._ptr
        return p if isinstance(p, int) else ctypes.cast(p, ctypes.c_void_p).value

    @property
    def memory(self):
        return _raw().llama_get_memory(self._ptr)

    def close(self) -> None:
        raw = _raw()
        if getattr(self, "_batch", None) is not None:
            raw.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ptr", None):
            raw.llama_free(self._ptr)
            self._ptr = None
            self.model._context_closed()   # frees the model if it was closed while this was open

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass

    def decode(self, tokens: Sequence[int], pos0: int, seq_id: int = 0, logits: str = "last") -> int:
        """Decode ``tokens`` at positions pos0.. in ``seq_id``; returns llama_decode's status.

        ``logits``: "last" (only the last token), "all", or "none". Batches larger than n_batch are
        split. A non-zero status (e.g. 1: no KV slot) is returned, not raised.
        """
        raw = _raw()
        n_batch = self.config.n_batch
        status = 0
        for start in range(0, len(tokens), n_batch):
            chunk = tokens[start:start + n_batch]
            b = self._batch
            b.n_tokens = len(chunk)
            last_chunk = start + n_batch >= len(tokens)
            for i, t in enumerate(chunk):
                b.token[i] = t
                b.pos[i] = pos0 + start + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq_id
                want = logits == "all" or (logits == "last" and last_chunk and i == len(chunk) - 1)
                b.logits[i] = 1 if want else 0
            status = raw.llama_decode(self._ptr, b)
            if status != 0:
                return status
        return status

    def decode_batch(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
                     logits: Sequence[bool]) -> int:
        """One llama_decode of tokens of several sequences (row i: ``tokens[i]`` at ``positions[i]`` in
        ``seq_ids[i]``, with logits if ``logits[i]``); returns its status. At most n_batch tokens."""
        n = len(tokens)
        if not 0 < n <= self.config.n_batch:
            raise NativeError(f"a batch holds 1..{self.config.n_batch} tokens, got {n}")
        b = self._batch
        b.n_tokens = n
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq_ids[i]
            b.logits[i] = 1 if logits[i] else 0
        return _raw().llama_decode(self._ptr, b)

    def logits(self, i: int = -1) -> np.ndarray:
        """Logits of output row ``i`` (-1: the last output) as a float32 numpy view copy."""
        raw = _raw()
        ptr = raw.llama_get_logits_ith(self._ptr, i)
        if not ptr:
            raise NativeError(f"no logits for output {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Upstream llama_memory_seq_rm: drop positions [p0, p1) of seq_id (p1 < 0: to the end)."""
        return bool(_raw().llama_memory_seq_rm(self.memory, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int) -> None:
        """Upstream llama_memory_seq_cp of the whole sequence ``src`` to ``dst`` (across streams: the
        K/V data is copied by the next decode, before its graph runs)."""
        _raw().llama_memory_seq_cp(self.memory, src, dst, -1, -1)

    def clear(self) -> None:
        _raw().llama_memory_clear(self.memory, True)
