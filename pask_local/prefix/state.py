"""One sequence's K/V as bytes, and back: llama.cpp's sequence state (``llama_state_seq_*``).

A layered context (``kv_layered``) writes a stream-agnostic layout (``native/src/pask-kv-layered.cpp``:
per layer the kept cells, their positions and K/V rows), so a prefix saved from a one-sequence
context restores into any sequence of a pool. Upstream's cache (Full KV) writes one record per KV
stream, of which only the sequence's own holds cells: ``save`` keeps that one record and ``restore``
lays it out again for the target context's stream count. A sliding-window model's upstream cache
writes two such records (base and window caches) whose boundary only llama.cpp knows: its state
restores into a context with the saved stream count only.

The bytes start with a one-byte tag: ``L`` layered, ``P`` upstream's with one record per sequence
(restores anywhere), ``R`` upstream's as written (restores where the stream count is the same).
"""

from __future__ import annotations

import ctypes
import struct

from ..errors import NativeError, PaskError
from ..kv_layered import LayeredContext
from ..llm import Context
from ..model_info import swa_layers

_HEAD = 8  # upstream's sequence-state header: u32 magic, i32 seq_id


def _lib():
    import llama_cpp

    return llama_cpp


def kind_of(ctx: Context) -> str:
    """"layered" (the pask cache) or "plain" (upstream's): a state restores only into its own kind."""
    return "layered" if isinstance(ctx, LayeredContext) else "plain"


def _streams(ctx: Context) -> int:
    cfg = ctx.config
    return 1 if cfg.kv_unified or cfg.n_seq_max <= 1 else cfg.n_seq_max


def save(ctx: Context, seq: int) -> bytes:
    """The state of ``seq`` (K/V rows and positions of every layer) as bytes, in a stream-agnostic form."""
    lib = _lib()
    size = int(lib.llama_state_seq_get_size(ctx.ptr, seq))
    if size <= _HEAD:
        raise NativeError(f"sequence {seq} has no state to save")
    buf = (ctypes.c_uint8 * size)()
    got = int(lib.llama_state_seq_get_data(ctx.ptr, buf, size, seq))
    if got <= _HEAD:
        raise NativeError(f"saving the state of sequence {seq} failed")
    data = bytes(buf)[:got]
    if kind_of(ctx) == "layered":
        return b"L" + data
    if swa_layers(ctx.model)[1] > 0:
        return b"R" + data
    return b"P" + _plain_to_one_stream(data)


def restore(ctx: Context, seq: int, state: bytes) -> None:
    """Put a state from ``save`` into ``seq`` of ``ctx`` (its earlier content is removed). Raises
    ``PaskError`` when the state does not fit this context (another model, too few cells, damaged)."""
    tag, body = state[:1], state[1:]
    want = b"L" if kind_of(ctx) == "layered" else b"PR"
    if not tag or tag not in want:
        raise PaskError("the saved K/V was made for another kind of KV cache (Full KV vs a compressed method)")
    if tag == b"P":
        data = _one_stream_to_plain(body, _streams(ctx))
    else:
        data = body
        if tag == b"R" and (len(body) < _HEAD + 4 or struct.unpack_from("<I", body, _HEAD)[0] != _streams(ctx)):
            raise PaskError("a Full KV prefix of a sliding-window model restores only into a context with the "
                            "stream count it was saved from (one slot)")
    lib = _lib()
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    got = int(lib.llama_state_seq_set_data(ctx.ptr, buf, len(data), seq))
    if got != len(data):
        ctx.seq_rm(seq, -1, -1)
        raise PaskError("the saved K/V does not fit this model's cache (another model, too few cells, "
                        "or a damaged state)")


def _plain_to_one_stream(data: bytes) -> bytes:
    """Upstream's [head][n_stream][per stream: cell_count, record] -> [head][cell_count][record]."""
    (n_stream,) = struct.unpack_from("<I", data, _HEAD)
    at = _HEAD + 4
    for s in range(n_stream):
        (count,) = struct.unpack_from("<I", data, at)
        at += 4
        if count:
            end = len(data) - 4 * (n_stream - 1 - s)  # the later streams are empty: a zero count each
            return data[:_HEAD] + struct.pack("<I", count) + data[at:end]
    raise NativeError("the sequence holds no cells")


def _one_stream_to_plain(state: bytes, n_stream: int) -> bytes:
    if len(state) < _HEAD + 4:
        raise PaskError("the saved K/V is truncated")
    # upstream restores a sequence's record into that sequence's own stream, whichever slot it is in
    return state[:_HEAD] + struct.pack("<I", n_stream) + state[_HEAD:] + b"\0" * 4 * (n_stream - 1)
