"""Validates a GGUF file's header, metadata and tensor table before llama.cpp sees it.

llama.cpp trusts much of a GGUF: absurd metadata (zero layers, a 2^31 context, head counts that do
not divide) or a tensor table pointing past the end of the file can make it allocate wildly or hit
a ``GGML_ASSERT`` that kills the process. ``check_gguf_file`` reads only the header, the key/value
metadata and the tensor table (no tensor data, no hashing: milliseconds on a 1 GB model; array
values are skipped, not decoded) and raises a one-line ``ModelError`` naming what is wrong. The
value types, quantization block sizes and key names come from the ``gguf`` package; ``gguf``'s
own ``GGUFReader`` decodes every array element eagerly (17 s on Gemma 3's 262k-token vocabulary),
so the walk over the file is done here with ``struct``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ModelError

MAX_KV = 1 << 16               # metadata entries
MAX_TENSORS = 1 << 20          # tensor table entries
MAX_KEY_BYTES = 1 << 16        # one key or tensor name
MAX_DIMS = 4                   # GGML_MAX_DIMS
MAX_LAYERS = 4096              # {arch}.block_count
MAX_CONTEXT = 1 << 24          # {arch}.context_length (16M tokens)
MAX_EMBD = 1 << 18             # {arch}.embedding_length
MAX_HEADS = 1 << 12            # attention heads per layer
MAX_VOCAB = 1 << 24            # tokenizer.ggml.tokens entries
KEEP_ARRAY = 1 << 12           # numeric arrays up to this length are decoded (per-layer values)

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFSummary:
    """What the check read: the metadata scalars (arrays as their length, small numeric arrays whole)
    and the tensor table (name -> (shape, type id, offset, n_bytes))."""

    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    array_len: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, tuple[tuple[int, ...], int, int, int]] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Bad(Exception):
    """A problem found while walking the file (turned into a ModelError with the path)."""


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, size: int) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Bad(f"truncated: {what} at byte {self.pos} runs past the end of the file ({self.size} bytes)")

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str, limit: int | None = None, decode: bool = True, name: bool = False) -> str:
        """A GGUF string; ``name``: a key or tensor name, made printable (it goes into messages)."""
        n = self.unpack("<Q", what + " length")
        if limit is not None and n > limit:
            raise _Bad(f"{what} is {n} bytes long (at most {limit})")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n]) if decode else b""
        self.pos += n
        text = raw.decode("utf-8", "replace")
        if name:
            text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:200])
        return text


_U64 = struct.Struct("<Q")


def _skip_strings(buf: mmap.mmap | bytes, pos: int, count: int, size: int, key: str) -> int:
    """The position after ``count`` length-prefixed strings at ``pos`` (a tight loop: vocabularies
    hold 100k+ strings)."""
    unpack = _U64.unpack_from
    for _ in range(count):
        if pos + 8 > size:
            break
        pos += 8 + unpack(buf, pos)[0]
    else:
        if pos <= size:
            return pos
    raise _Bad(f"truncated: the string array '{key}' runs past the end of the file ({size} bytes)")


def _value(cur: _Cursor, vtype: int, key: str, summary: GGUFSummary) -> Any:
    if vtype in _SCALAR:
        return cur.unpack(_SCALAR[vtype], f"the value of '{key}'")
    if vtype == _STRING:
        return cur.string(f"the value of '{key}'")
    if vtype != _ARRAY:
        raise _Bad(f"metadata '{key}' has unknown value type {vtype}")
    etype = cur.unpack("<I", f"the array type of '{key}'")
    count = cur.unpack("<Q", f"the array length of '{key}'")
    summary.array_len[key] = count
    if etype in _SCALAR:
        width = struct.calcsize(_SCALAR[etype])
        cur.need(count * width, f"the array '{key}' ({count} elements)")
        if count <= KEEP_ARRAY:
            values = list(struct.unpack_from(f"<{count}{_SCALAR[etype][1]}", cur.buf, cur.pos))
            cur.pos += count * width
            return values
        cur.pos += count * width
        return None
    if etype == _STRING:
        cur.need(count * 8, f"the array '{key}' ({count} strings)")  # each string has an 8-byte length
        cur.pos = _skip_strings(cur.buf, cur.pos, count, cur.size, key)
        return None
    raise _Bad(f"metadata '{key}' is an array of unsupported type {etype}")


def _walk(cur: _Cursor, file_size: int) -> GGUFSummary:
    import gguf

    magic = cur.unpack("<I", "the magic")
    if magic != gguf.GGUF_MAGIC:
        raise _Bad(f"not a GGUF file (bad magic {struct.pack('<I', magic)!r})")
    version = cur.unpack("<I", "the version")
    if version not in (2, 3):
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        hint = " (a big-endian GGUF?)" if swapped in (2, 3) else ""
        raise _Bad(f"unsupported GGUF version {version}{hint}")
    n_tensors = cur.unpack("<Q", "the tensor count")
    n_kv = cur.unpack("<Q", "the metadata count")
    if n_kv > MAX_KV:
        raise _Bad(f"{n_kv} metadata entries (at most {MAX_KV})")
    if n_tensors > MAX_TENSORS or n_tensors * 24 > file_size:
        raise _Bad(f"{n_tensors} tensors announced in a {file_size}-byte file")
    s = GGUFSummary(version=version)
    for _ in range(n_kv):
        key = cur.string("a metadata key", MAX_KEY_BYTES, name=True)
        if key in s.metadata:
            raise _Bad(f"metadata key '{key}' appears twice")
        vtype = cur.unpack("<I", f"the type of '{key}'")
        s.metadata[key] = _value(cur, vtype, key, s)
    for _ in range(n_tensors):
        name = cur.string("a tensor name", MAX_KEY_BYTES, name=True)
        n_dims = cur.unpack("<I", f"the dimension count of tensor '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _Bad(f"tensor '{name}' has {n_dims} dimensions (1..{MAX_DIMS})")
        shape = tuple(cur.unpack("<Q", f"a dimension of tensor '{name}'") for _ in range(n_dims))
        ttype = cur.unpack("<I", f"the type of tensor '{name}'")
        offset = cur.unpack("<Q", f"the offset of tensor '{name}'")
        if name in s.tensors:
            raise _Bad(f"tensor '{name}' appears twice")
        s.tensors[name] = (shape, ttype, offset, _tensor_bytes(name, shape, ttype))
    align = s.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise _Bad(f"general.alignment {align!r} is not a power of two")
    data_start = -(-cur.pos // align) * align
    data_size = file_size - data_start
    end, last = 0, ""
    for name, (_, _, offset, nbytes) in sorted(s.tensors.items(), key=lambda kv: kv[1][2]):
        if offset % align:
            raise _Bad(f"tensor '{name}' data offset {offset} is not aligned to {align}")
        if offset < end:
            raise _Bad(f"tensor '{last}' ({end - s.tensors[last][2]} bytes by its shape) overlaps tensor '{name}'")
        if offset + nbytes > data_size:
            raise _Bad(f"truncated: tensor '{name}' ({nbytes} bytes at data offset {offset}) runs past the end "
                       f"of the file ({data_size} data bytes)")
        end, last = offset + nbytes, name
    return s


def _tensor_bytes(name: str, shape: tuple[int, ...], ttype: int) -> int:
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(ttype)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise _Bad(f"tensor '{name}' has unknown type {ttype}") from None
    n = 1
    for d in shape:
        if d <= 0 or d >= 1 << 40:
            raise _Bad(f"tensor '{name}' has dimension {d} in shape {list(shape)}")
        n *= d
    if n >= 1 << 62:
        raise _Bad(f"tensor '{name}' shape {list(shape)} overflows")
    if shape[0] % block:
        raise _Bad(f"tensor '{name}' row of {shape[0]} elements is not a multiple of its {qtype.name} block ({block})")
    return n // block * size


def _int_or_list(s: GGUFSummary, key: str) -> list[int] | None:
    """A scalar integer or a per-layer integer array as a list (None: absent or not decoded)."""
    if key not in s.metadata:
        return None
    v = s.metadata[key]
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, list) and all(isinstance(x, int) for x in v))):
        raise _Bad(f"metadata '{key}' must be an integer or a list of integers, got {type(v).__name__}")
    return v if isinstance(v, list) else [v]


def _check_metadata(s: GGUFSummary) -> None:
    arch = s.metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise _Bad("metadata 'general.architecture' is missing")

    def scalar(name: str, lo: int, hi: int) -> int | None:
        key = f"{arch}.{name}"
        vals = _int_or_list(s, key)
        if vals is None:
            return None
        if len(vals) != 1:
            raise _Bad(f"metadata '{key}' must be one integer")
        if not lo <= vals[0] <= hi:
            raise _Bad(f"metadata '{key}' = {vals[0]} is out of range {lo}..{hi}")
        return vals[0]

    n_layer = scalar("block_count", 1, MAX_LAYERS)
    scalar("context_length", 1, MAX_CONTEXT)
    n_embd = scalar("embedding_length", 1, MAX_EMBD)
    if not isinstance(s.metadata.get(f"{arch}.feed_forward_length"), list):  # a list: per-layer sizes
        scalar("feed_forward_length", 0, 1 << 20)
    heads = _int_or_list(s, f"{arch}.attention.head_count")
    heads_kv = _int_or_list(s, f"{arch}.attention.head_count_kv")
    key_len = scalar("attention.key_length", 1, 1 << 16)
    scalar("attention.value_length", 1, 1 << 16)
    for key, vals in ((f"{arch}.attention.head_count", heads), (f"{arch}.attention.head_count_kv", heads_kv)):
        if vals is None:
            continue
        if len(vals) != 1 and n_layer is not None and len(vals) != n_layer:
            raise _Bad(f"metadata '{key}' has {len(vals)} entries for {n_layer} layers")
        if any(not 0 <= h <= MAX_HEADS for h in vals):
            raise _Bad(f"metadata '{key}' = {vals if len(vals) > 1 else vals[0]} is out of range 0..{MAX_HEADS}")
    # a model without attention (Mamba, RWKV: their state keys are {arch}.ssm.* / {arch}.wkv.*) may say
    # 0 heads; whether pask-local can run it is the layered cache's verdict, naming the architecture
    recurrent = any(k.startswith((f"{arch}.ssm.", f"{arch}.wkv.", f"{arch}.rescale_every")) for k in s.metadata)
    if heads is not None and not any(heads) and not recurrent:
        raise _Bad(f"metadata '{arch}.attention.head_count' is 0 in every layer")
    if heads is not None:
        kv = heads_kv if heads_kv is not None else heads
        n = max(len(heads), len(kv))
        for il in range(n):
            h, hk = heads[il % len(heads)], kv[il % len(kv)]
            if h and not hk:
                raise _Bad(f"metadata '{arch}.attention.head_count_kv' is 0 where head_count is {h}")
            if h and hk and h % hk:
                raise _Bad(f"metadata '{arch}.attention.head_count' {h} is not a multiple of head_count_kv {hk}")
            if h and key_len is None and n_embd is not None and n_embd % h:
                raise _Bad(f"metadata '{arch}.embedding_length' {n_embd} is not divisible by head_count {h} "
                           "(and no key_length is given)")
    n_vocab = s.array_len.get("tokenizer.ggml.tokens")
    if n_vocab is not None and not 1 <= n_vocab <= MAX_VOCAB:
        raise _Bad(f"metadata 'tokenizer.ggml.tokens' has {n_vocab} entries (1..{MAX_VOCAB})")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if n_vocab is not None and key in s.array_len and s.array_len[key] != n_vocab:
            raise _Bad(f"metadata '{key}' has {s.array_len[key]} entries for {n_vocab} tokens")
    emb = s.tensors.get("token_embd.weight")
    if emb is not None and n_embd is not None and emb[0][0] != n_embd:
        raise _Bad(f"tensor 'token_embd.weight' shape {list(emb[0])} does not match embedding_length {n_embd}")
    if emb is not None and n_vocab is not None and len(emb[0]) > 1 and emb[0][1] != n_vocab:
        raise _Bad(f"tensor 'token_embd.weight' shape {list(emb[0])} does not match the {n_vocab}-token vocabulary")


_CHECKED: dict[tuple[str, int, int], GGUFSummary] = {}


def check_gguf_file(path: str | Path) -> GGUFSummary:
    """Validate the GGUF at ``path`` (header, metadata, tensor table); ``ModelError`` on the first problem.

    A file already found sane (same path, size and mtime) is not read again in this process.
    """
    p = Path(path)
    try:
        st = p.stat()
        memo = (str(p.resolve()), st.st_size, st.st_mtime_ns)
        if memo in _CHECKED:
            return _CHECKED[memo]
        with open(p, "rb") as f:
            size = st.st_size
            if size < 24:
                head = f.read(4)
                if head[:4] != b"GGUF":
                    raise ModelError(f"{p} is not a GGUF file (bad magic {head[:4]!r})")
                raise ModelError(f"{p} is truncated ({size} bytes, the GGUF header alone is 24)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                summary = _walk(_Cursor(buf, size), size)
                _check_metadata(summary)
    except _Bad as exc:
        raise ModelError(f"{p}: {exc}") from None
    except OSError as exc:
        raise ModelError(f"cannot read {p}: {exc.strerror or exc}") from None
    _CHECKED[memo] = summary
    return summary
