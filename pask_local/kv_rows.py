"""The K rows a layered cache holds for one sequence, read from its saved sequence state.

``llama_state_seq_get_data`` on a layered context (``native/src/pask-kv-layered.cpp``) writes, after
upstream's 8-byte sequence header: ``PKVL`` magic, version, layer count, the position high-water
mark, then per layer a flag and, if set, the cell count, a byte count and that layer's upstream
per-stream record: per cell its position, sequence count and sequence ids, then ``v_trans``, the
layer count (1), the K type, the K row size and the K rows (then V, not read here). ``key_rows``
parses that and returns each layer's positions and K rows as float32 (f32, f16 and q8_0 caches);
anything else in the bytes is a one-line ``NativeError``, never a wrong read.
"""

from __future__ import annotations

import struct

import numpy as np

from .errors import NativeError

_HEAD = 8
_MAGIC = 0x4C564B50
_F32, _F16, _Q8_0 = 0, 1, 8
_Q8_BLOCK = 32  # values per q8_0 block: an f16 scale and 32 int8


def _rows(buf: bytes, at: int, n: int, k_type: int, row: int) -> np.ndarray:
    raw = np.frombuffer(buf, dtype=np.uint8, count=n * row, offset=at).reshape(n, row)
    if k_type == _F32 and row % 4 == 0:
        return raw.view(np.float32).copy()
    if k_type == _F16 and row % 2 == 0:
        return raw.view(np.float16).astype(np.float32)
    if k_type == _Q8_0 and row % (2 + _Q8_BLOCK) == 0:
        blocks = raw.reshape(n, row // (2 + _Q8_BLOCK), 2 + _Q8_BLOCK)
        scale = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)
        return (blocks[:, :, 2:].view(np.int8).astype(np.float32) * scale).reshape(n, -1)
    raise NativeError(f"K rows of type {k_type} with {row} bytes per row are not readable here")


def key_rows(state: bytes) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Per layer (None: a layer without K/V): the held positions (int64 [n]) and their K rows
    (float32 [n, n_embd_k_gqa]), from a layered context's sequence state."""
    try:
        magic, _version, n_layer, _hw = struct.unpack_from("<IIIi", state, _HEAD)
        if magic != _MAGIC:
            raise NativeError("not a layered cache's sequence state")
        at = _HEAD + 16
        out: list[tuple[np.ndarray, np.ndarray] | None] = []
        for _ in range(n_layer):
            has = state[at]
            at += 1
            if not has:
                out.append(None)
                continue
            n_cells, n_bytes = struct.unpack_from("<IQ", state, at)
            at += 12
            end = at + n_bytes
            pos = np.empty(n_cells, dtype=np.int64)
            p = at
            for i in range(n_cells):
                pos[i], n_seq = struct.unpack_from("<iI", state, p)
                p += 8 + 4 * n_seq
            v_trans, layers, k_type, row = struct.unpack_from("<IIiQ", state, p)
            p += 20
            if v_trans > 1 or layers != 1 or p + n_cells * row > end:
                raise NativeError("unexpected layer record in a layered cache's sequence state")
            out.append((pos, _rows(state, p, n_cells, k_type, row)))
            at = end
        return out
    except (struct.error, IndexError, ValueError) as exc:
        raise NativeError(f"a layered cache's sequence state could not be read ({exc})") from None
