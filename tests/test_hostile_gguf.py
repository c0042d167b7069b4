"""Hostile model files: truncated, wrong magic/version, a tensor whose size does not match, absurd
metadata. Each is built from the project's own synthetic writer plus byte edits and must end in a
one-line ``error:`` from the CLI (exit code > 0, not a signal, no traceback) before llama.cpp can
abort; the checker itself reads only the header (fast on the real 250 MB Gemma file)."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from pask_local.calibration.synthetic import write_synthetic_gguf

from pask_local.errors import ModelError
from pask_local.gguf_check import check_gguf_file


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "good.gguf"
    write_synthetic_gguf(path, arch="qwen3", n_layer=2)
    return path.read_bytes()


def _key_value_at(data: bytes, key: str) -> int:
    """Offset of the value of metadata ``key`` (after its u64 length, bytes and u32 type)."""
    raw = key.encode()
    i = data.find(struct.pack("<Q", len(raw)) + raw)
    assert i >= 0, key
    return i + 8 + len(raw) + 4


def set_u32(key: str, value: int) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        at = _key_value_at(data, key)
        return data[:at] + struct.pack("<I", value) + data[at + 4:]
    return edit


def rename_key(key: str, new: str) -> Callable[[bytes], bytes]:
    assert len(key) == len(new)

    def edit(data: bytes) -> bytes:
        assert data.count(key.encode()) == 1
        return data.replace(key.encode(), new.encode())
    return edit


def tensor_dim(name: str, dim: int, value: int) -> Callable[[bytes], bytes]:
    """Set dimension ``dim`` of tensor ``name`` in the tensor table."""
    def edit(data: bytes) -> bytes:
        raw = name.encode()
        i = data.find(struct.pack("<Q", len(raw)) + raw)
        assert i >= 0, name
        at = i + 8 + len(raw) + 4 + 8 * dim
        return data[:at] + struct.pack("<Q", value) + data[at + 8:]
    return edit


def chain(*edits: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        for e in edits:
            data = e(data)
        return data
    return edit


# (case id, edit of the good file's bytes, a fragment the one-line error must contain)
CASES: list[tuple[str, Callable[[bytes], bytes], str]] = [
    ("empty", lambda d: b"", "not a GGUF file"),
    ("header-cut", lambda d: d[:20], "truncated"),
    ("metadata-cut", lambda d: d[:2000], "truncated"),
    ("tensor-data-cut", lambda d: d[: len(d) // 2], "runs past the end"),
    ("last-bytes-cut", lambda d: d[:-1], "runs past the end"),
    ("wrong-magic", lambda d: b"GGUX" + d[4:], "not a GGUF file"),
    ("zero-magic", lambda d: b"\0" * len(d), "not a GGUF file"),
    ("wrong-version", lambda d: d[:4] + struct.pack("<I", 99) + d[8:], "unsupported GGUF version 99"),
    ("big-endian", lambda d: d[:4] + struct.pack(">I", 3) + d[8:], "big-endian"),
    ("tensor-count-huge", lambda d: d[:8] + struct.pack("<Q", 1 << 40) + d[16:], "tensors announced"),
    ("kv-count-huge", lambda d: d[:16] + struct.pack("<Q", 1 << 40) + d[24:], "metadata entries"),
    ("tensor-bigger-than-file", tensor_dim("output.weight", 1, 1 << 30), "runs past the end"),
    ("tensor-overlaps-next", tensor_dim("blk.0.attn_q.weight", 1, 4096), "overlaps"),
    ("tensor-dim-zero", tensor_dim("blk.0.attn_k.weight", 0, 0), "dimension 0"),
    ("embd-shape-vs-metadata", chain(tensor_dim("token_embd.weight", 0, 32), tensor_dim("token_embd.weight", 1, 640)),
     "does not match embedding_length"),
    ("n-layer-0", set_u32("qwen3.block_count", 0), "'qwen3.block_count' = 0 is out of range"),
    ("n-layer-huge", set_u32("qwen3.block_count", 1 << 31), "'qwen3.block_count'"),
    ("context-2^31", set_u32("qwen3.context_length", 1 << 31), "'qwen3.context_length' = 2147483648"),
    ("n-embd-0", set_u32("qwen3.embedding_length", 0), "'qwen3.embedding_length' = 0"),
    ("heads-not-multiple-of-kv", set_u32("qwen3.attention.head_count", 3), "not a multiple of head_count_kv"),
    ("kv-heads-0", set_u32("qwen3.attention.head_count_kv", 0), "head_count_kv' is 0"),
    ("heads-0", set_u32("qwen3.attention.head_count", 0), "is 0 in every layer"),
    ("heads-do-not-divide-embd", chain(set_u32("qwen3.attention.head_count", 6),
                                       rename_key("qwen3.attention.key_length", "qwen3.attention.xey_length"),
                                       rename_key("qwen3.attention.value_length", "qwen3.attention.xalue_length")),
     "not divisible by head_count 6"),
    ("tensor-type-unknown", lambda d: _tensor_type(d, "output_norm.weight", 250), "unknown type 250"),
]


def _tensor_type(data: bytes, name: str, ttype: int) -> bytes:
    raw = name.encode()
    i = data.find(struct.pack("<Q", len(raw)) + raw)
    at = i + 8 + len(raw)
    (n_dims,) = struct.unpack_from("<I", data, at)
    at += 4 + 8 * n_dims
    return data[:at] + struct.pack("<I", ttype) + data[at + 4:]


@pytest.mark.parametrize("case,edit,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_gguf_is_a_one_line_model_error(good: bytes, tmp_path: Path, case: str, edit, fragment: str) -> None:
    bad = tmp_path / f"{case}.gguf"
    bad.write_bytes(edit(good))
    with pytest.raises(ModelError) as err:
        check_gguf_file(bad)
    msg = str(err.value)
    assert fragment in msg, msg
    assert "\n" not in msg and str(bad) in msg


def test_good_files_pass_and_the_real_model_is_checked_fast(good: bytes, tmp_path: Path, gemma_path: Path) -> None:
    (tmp_path / "good.gguf").write_bytes(good)
    s = check_gguf_file(tmp_path / "good.gguf")
    assert s.arch == "qwen3" and s.metadata["qwen3.block_count"] == 2 and "output.weight" in s.tensors
    t0 = time.perf_counter()
    real = check_gguf_file(gemma_path)
    assert time.perf_counter() - t0 < 5.0  # a cold cache and 2 busy cores; warm it is ~0.1 s
    assert real.arch == "gemma3" and real.array_len["tokenizer.ggml.tokens"] == 262144
    assert len(real.tensors) > 100


CLI_CASES = ["metadata-cut", "tensor-data-cut", "wrong-magic", "tensor-bigger-than-file", "n-layer-0",
             "context-2^31", "heads-not-multiple-of-kv", "heads-do-not-divide-embd"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_refuses_bad_gguf_in_one_line(good: bytes, tmp_path: Path, case: str) -> None:
    edit, fragment = {c: (e, f) for c, e, f in CASES}[case]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(edit(good))
    proc = run_cli("run", "--gguf", str(bad), "--schema", str(REPO / "examples" / "get_weather.json"),
                   "--method", "full", "Weather in Oslo?", timeout=120, env={"PASK_THREADS": "1"})
    assert proc.returncode > 0, (proc.returncode, proc.stderr)  # > 0: not killed by a signal
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert fragment in lines[0] and "Traceback" not in proc.stderr + proc.stdout
