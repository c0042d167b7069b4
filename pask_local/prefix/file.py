"""The prefix file (``.pkv``): a compressed prefix's K/V and everything needed to trust it.

Layout: ``MAGIC`` (8 bytes), u32 format version (2), u64 header length, the header (UTF-8 JSON),
u64 state length, the state (``prefix.state``: per layer the kept cells' positions and K/V rows), and
a sha256 of everything before it. The header names the model (its file's sha256), the template, the
tools and system prompt (sha256 of each), the method, budget and policy, the K/V type, the prefix's
tokens and their structural classes, and per layer the positions kept.

The header is a JSON object with one key per ``PrefixHeader`` field; three are packed (version 2):

- ``tokens``: base64 of the token ids as little-endian uint32;
- ``classes``: ``{"names": [the distinct class strings], "codes": base64 of one uint8 per token,
  an index into names}`` (at most 255 names);
- ``kept``: one base64 bitmap per layer over the prefix's positions, ceil(n_tokens / 8) bytes, little
  bit order (bit ``i % 8`` of byte ``i // 8`` set: position ``i`` kept; the bits past n_tokens clear).
  Positions are read back in ascending order.

Version 1 wrote the three as JSON lists (about 0.5 MB for an 8k-token catalog); it is refused.

A file is untrusted input: ``read`` bounds its size from the model before reading it, checks the
magic, version and checksum before parsing anything, and validates every header field's type and
range (every packed field's base64, byte length and indices); a header may list no more kept entries
than its state has bytes, so a small file cannot unpack into a huge one. Nothing in it is executed.
``PrefixFileError`` carries a one-line reason.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import PaskError

MAGIC = b"PASKPKV\x00"
VERSION = 2
MAX_HEADER = 64 << 20  # bytes of header JSON (tokens and per-layer positions of a long prefix)
MAX_CLASSES = 255      # distinct class names one uint8 code per token indexes


class PrefixFileError(PaskError):
    """A prefix file that cannot be used (one line: which file, why)."""


@dataclass
class PrefixHeader:
    """What a prefix file says about its K/V."""

    model_sha256: str
    model_name: str
    n_layer: int
    upstream: str               # the llama-cpp-python version whose state layout the file holds
    template_sha256: str        # the chat template the prefix was rendered with
    style: str                  # the prompt style (native, plain)
    tools_sha256: str
    system_sha256: str          # the messages before the user's turn (a system prompt), canonical JSON
    method: str
    budget: float | None        # None: Full KV
    policy_sha256: str | None
    kv_type: str
    tokens: list[int]
    classes: list[str]          # the structural class of each prefix token
    kept: list[list[int]]       # per layer, the positions the compressed prefix holds
    state_kind: str             # "layered" or "plain" (prefix.state)
    extra: dict[str, Any] = field(default_factory=dict)  # informational (tool names, timings)

    @property
    def n_prefix(self) -> int:
        return len(self.tokens)

    def held(self) -> int:
        """K/V entries the file holds (all layers)."""
        return sum(len(k) for k in self.kept)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_json(value: Any) -> str:
    """sha256 of a JSON value in a canonical form (sorted keys, no spaces)."""
    return sha256_text(json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False))


def write(path: Path, header: PrefixHeader, state: bytes) -> int:
    """Write the file (atomically: a temporary name, then a rename); returns its size in bytes."""
    head = _encode_header(header)
    body = MAGIC + struct.pack("<IQ", VERSION, len(head)) + head + struct.pack("<Q", len(state)) + state
    data = body + hashlib.sha256(body).digest()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(data)


def read(path: Path, max_state: int) -> tuple[PrefixHeader, bytes]:
    """(header, state) of a prefix file, after every check that needs no model run (module doc).
    ``max_state``: the most K/V bytes the caller's model can have (its whole trained context)."""
    name = path.name
    fixed = len(MAGIC) + 12 + 8 + 32  # magic, version, header length, state length, checksum
    try:
        if not path.is_file():
            raise PrefixFileError(f"prefix file {path} is not a file")
        size = path.stat().st_size
        if size < fixed:
            raise PrefixFileError(f"prefix file {name} is truncated ({size} bytes)")
        with path.open("rb") as f:
            start = f.read(len(MAGIC) + 12)
            if start[:len(MAGIC)] != MAGIC:
                raise PrefixFileError(f"{name} is not a pask-local prefix file")
            version, n_head = struct.unpack_from("<IQ", start, len(MAGIC))
            if version != VERSION:
                raise PrefixFileError(f"prefix file {name} has format version {version}; this pask-local reads "
                                      f"version {VERSION} (compress the prefix again)")
            if n_head > MAX_HEADER or fixed + n_head > size:
                raise PrefixFileError(f"prefix file {name} is damaged or was modified (header length)")
            if size - fixed - n_head > max_state:  # bounded before the K/V is read
                raise PrefixFileError(f"prefix file {name} holds {size - fixed - n_head} bytes of K/V, more than "
                                      f"this model's whole context can ({max_state})")
            data = start + f.read()
    except OSError as exc:
        raise PrefixFileError(f"cannot read prefix file {path}: {exc.strerror}") from None
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise PrefixFileError(f"prefix file {name} is damaged or was modified (checksum mismatch)")
    at = len(MAGIC) + 12
    head = body[at:at + n_head]
    (n_state,) = struct.unpack_from("<Q", body, at + n_head)
    state = body[at + n_head + 8:]
    if n_state != len(state):
        raise PrefixFileError(f"prefix file {name} is malformed (state length)")
    try:
        header = _parse_header(json.loads(head.decode("utf-8")), len(state))
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, TypeError, KeyError) as exc:
        raise PrefixFileError(f"prefix file {name} has a malformed header ({str(exc)[:120]})") from None
    return header, state


def _encode_header(header: PrefixHeader) -> bytes:
    """The header's on-disk JSON (module doc: tokens, classes and kept packed). ValueError for a
    header no file can hold (a token outside uint32, too many classes, a kept position outside the
    prefix or listed twice)."""
    raw = asdict(header)
    n = len(header.tokens)
    raw["tokens"] = _encode_tokens(header.tokens)
    raw["classes"] = _encode_classes(header.classes, n)
    raw["kept"] = [_encode_bitmap(positions, n) for positions in header.kept]
    return json.dumps(raw, separators=(",", ":")).encode("utf-8")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"{what} is not a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not valid base64") from None


def _encode_tokens(tokens: list[int]) -> str:
    if not _ints(tokens) or any(t < 0 or t >= 1 << 32 for t in tokens):
        raise ValueError("tokens are not uint32 integers")
    return _b64(np.asarray(tokens, dtype="<u4").tobytes())


def _decode_tokens(value: Any) -> list[int]:
    data = _unb64(value, "tokens")
    if not data or len(data) % 4:
        raise ValueError(f"tokens are {len(data)} bytes, not a positive multiple of 4")
    return np.frombuffer(data, dtype="<u4").tolist()


def _encode_classes(classes: list[str], n: int) -> dict[str, Any]:
    if len(classes) != n or not all(isinstance(c, str) for c in classes):
        raise ValueError("classes do not match the tokens")
    names = list(dict.fromkeys(classes))
    if len(names) > MAX_CLASSES:
        raise ValueError(f"{len(names)} distinct classes, more than {MAX_CLASSES}")
    index = {name: i for i, name in enumerate(names)}
    return {"names": names, "codes": _b64(bytes(index[c] for c in classes))}


def _decode_classes(value: Any, n: int) -> list[str]:
    if not isinstance(value, dict) or set(value) != {"names", "codes"}:
        raise TypeError("classes is not an object of names and codes")
    names = value["names"]
    if not isinstance(names, list) or not all(isinstance(c, str) for c in names) or \
            len(set(names)) != len(names) or len(names) > MAX_CLASSES:
        raise TypeError("class names are not distinct strings")
    codes = _unb64(value["codes"], "class codes")
    if len(codes) != n:
        raise ValueError("classes do not match the tokens")
    if codes and max(codes) >= len(names):
        raise ValueError("a class code is outside the class names")
    return [names[c] for c in codes]


def _encode_bitmap(positions: list[int], n: int) -> str:
    if not _ints(positions) or any(p < 0 or p >= n for p in positions):
        raise ValueError("kept positions outside the prefix")
    bits = np.zeros(n, dtype=bool)
    bits[positions] = True
    if int(bits.sum()) != len(positions):
        raise ValueError("a kept position is listed twice")
    return _b64(np.packbits(bits, bitorder="little").tobytes())


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)


def _decode_kept(value: Any, n: int, n_layer: int, max_entries: int) -> list[list[int]]:
    if not isinstance(value, list) or len(value) != n_layer:
        raise ValueError("kept positions are not one bitmap per layer")
    size = (n + 7) // 8
    maps = []
    for i, bitmap in enumerate(value):
        data = np.frombuffer(_unb64(bitmap, f"kept bitmap {i}"), dtype=np.uint8)
        if len(data) != size:
            raise ValueError(f"kept bitmap {i} is {len(data)} bytes, not {size}")
        if n % 8 and data[-1] >> (n % 8):
            raise ValueError("kept positions outside the prefix")
        maps.append(data)
    held = sum(int(_POPCOUNT[m].sum()) for m in maps)
    if held > max_entries:  # each kept entry takes bytes of the state: bounds what the bitmaps unpack to
        raise ValueError(f"{held} kept entries, more than the {max_entries} bytes of K/V can hold")
    return [np.flatnonzero(np.unpackbits(m, count=n, bitorder="little")).tolist() for m in maps]


def _parse_header(raw: Any, n_state: int) -> PrefixHeader:
    if not isinstance(raw, dict):
        raise TypeError("not an object")
    fields = PrefixHeader.__dataclass_fields__
    unknown = set(raw) - set(fields)
    if unknown:
        raise KeyError(f"unknown field {sorted(unknown)[0]!r}")
    values = {k: raw[k] for k in fields if k in raw or k != "extra"}
    n_layer = values["n_layer"]
    if not isinstance(n_layer, int) or isinstance(n_layer, bool) or not 0 < n_layer <= 4096:
        raise ValueError("bad layer count")
    values["tokens"] = _decode_tokens(values["tokens"])
    n = len(values["tokens"])
    values["classes"] = _decode_classes(values["classes"], n)
    values["kept"] = _decode_kept(values["kept"], n, n_layer, n_state)
    h = PrefixHeader(**values)
    strings = ("model_sha256", "model_name", "upstream", "template_sha256", "style", "tools_sha256",
               "system_sha256", "method", "kv_type", "state_kind")
    for k in strings:
        if not isinstance(getattr(h, k), str):
            raise TypeError(f"{k} is not a string")
    if h.policy_sha256 is not None and not isinstance(h.policy_sha256, str):
        raise TypeError("policy_sha256 is not a string")
    if h.budget is not None and not (isinstance(h.budget, int | float) and 0.0 < h.budget <= 1.0):
        raise ValueError("budget is not in (0, 1]")
    # tokens (at least one), one class per token, one set of distinct positions inside the prefix per
    # layer: the decoders above check these (a bitmap cannot hold a duplicate or list a position twice)
    if not isinstance(h.extra, dict):
        raise TypeError("extra is not an object")
    if h.state_kind not in ("layered", "plain"):
        raise ValueError(f"unknown state kind {h.state_kind!r}")
    return h


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)
