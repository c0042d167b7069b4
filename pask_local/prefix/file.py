"""The prefix file (``.pkv``): a compressed prefix's K/V and everything needed to trust it.

Layout: ``MAGIC`` (8 bytes), u32 format version, u64 header length, the header (UTF-8 JSON), u64
state length, the state (``prefix.state``: per layer the kept cells' positions and K/V rows), and a
sha256 of everything before it. The header names the model (its file's sha256), the template, the
tools and system prompt (sha256 of each), the method, budget and policy, the K/V type, the prefix's
tokens and their structural classes, and per layer the positions kept.

A file is untrusted input: ``read`` bounds its size from the model before reading it, checks the
magic, version and checksum before parsing anything, and validates every header field's type and
range; nothing in it is executed. ``PrefixFileError`` carries a one-line reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PaskError

MAGIC = b"PASKPKV\x00"
VERSION = 1
MAX_HEADER = 64 << 20  # bytes of header JSON (tokens and per-layer positions of a long prefix)


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
    head = json.dumps(asdict(header), separators=(",", ":")).encode("utf-8")
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
        header = _parse_header(json.loads(head.decode("utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, TypeError, KeyError) as exc:
        raise PrefixFileError(f"prefix file {name} has a malformed header ({str(exc)[:120]})") from None
    return header, state


def _parse_header(raw: Any) -> PrefixHeader:
    if not isinstance(raw, dict):
        raise TypeError("not an object")
    fields = PrefixHeader.__dataclass_fields__
    unknown = set(raw) - set(fields)
    if unknown:
        raise KeyError(f"unknown field {sorted(unknown)[0]!r}")
    h = PrefixHeader(**{k: raw[k] for k in fields if k in raw or k != "extra"})
    strings = ("model_sha256", "model_name", "upstream", "template_sha256", "style", "tools_sha256",
               "system_sha256", "method", "kv_type", "state_kind")
    for k in strings:
        if not isinstance(getattr(h, k), str):
            raise TypeError(f"{k} is not a string")
    if h.policy_sha256 is not None and not isinstance(h.policy_sha256, str):
        raise TypeError("policy_sha256 is not a string")
    if h.budget is not None and not (isinstance(h.budget, int | float) and 0.0 < h.budget <= 1.0):
        raise ValueError("budget is not in (0, 1]")
    if not isinstance(h.n_layer, int) or not 0 < h.n_layer <= 4096:
        raise ValueError("bad layer count")
    if not _ints(h.tokens) or not h.tokens:
        raise TypeError("tokens are not a list of integers")
    if not isinstance(h.classes, list) or len(h.classes) != len(h.tokens) or \
            not all(isinstance(c, str) for c in h.classes):
        raise TypeError("classes do not match the tokens")
    if not isinstance(h.kept, list) or len(h.kept) != h.n_layer:
        raise ValueError("kept positions are not one list per layer")
    for positions in h.kept:
        if not _ints(positions) or any(p < 0 or p >= len(h.tokens) for p in positions) or \
                len(set(positions)) != len(positions):
            raise ValueError("kept positions outside the prefix")
    if not isinstance(h.extra, dict):
        raise TypeError("extra is not an object")
    if h.state_kind not in ("layered", "plain"):
        raise ValueError(f"unknown state kind {h.state_kind!r}")
    return h


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)
