"""pask_local.eval.kvbytes and ``pask-local study kv-bytes``: K/V bytes against Full KV f16 for the same requests.

The oracle for llama.cpp's allocation is the GGUF's shape (layers x KV heads x head size x K and V)
times the element size (f16: 2 bytes; q8_0: 34 bytes per block of 32), read with the ``gguf``
package, not with pask-local.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli
from gguf import GGUFReader

from pask_local.eval.kvbytes import kv_bytes, round_up
from pask_local.eval.study import StudyError

pytestmark = pytest.mark.slow


def _cell_bytes(gguf: Path) -> dict[str, float]:
    """Bytes of one cell over all layers, K and V, per element type, from the GGUF's metadata."""
    r = GGUFReader(gguf)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def val(key: str) -> int:
        return int(r.fields[f"{arch}.{key}"].parts[-1][0])

    elems = val("block_count") * val("attention.head_count_kv") * (val("embedding_length") // val("attention.head_count"))
    return {"f16": 2 * elems * 2, "q8_0": 2 * elems * 34 / 32}


def _rec(case: str, method: str, budget: float | None, n_prompt: int, alloc: int | None = None, align: int = 0,
         valid: bool | None = None) -> dict:
    """A record as ``pask-local eval`` writes it: Full KV's stats hold only its raw output (the lengths
    are top-level), an engine run's stats hold the lengths, the K/V bytes and the final share."""
    rec = {"id": case, "category": "simple", "method": method, "budget": budget,
           "valid": case != "c1" if valid is None else valid, "output": "o", "error_type": None, "seconds": 1.0,
           "n_prompt": n_prompt, "n_generated": 21}
    if method == "full":
        return rec | {"stats": {"raw_output": "o"}}
    stats = {"n_prompt": n_prompt, "n_gen": 21, "budget_used_final": 0.25 if case == "c0" else 0.5}
    if alloc is not None:
        stats |= {"kv_bytes_allocated": alloc, "kv_bytes_alignment": align}
    return rec | {"stats": stats}


def _write_study(root: Path, kv_type: str, recs: list[dict], model: str = "m.gguf") -> Path:
    for method in {r["method"] for r in recs}:
        d = root / method
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"model": model, "split": "eval", "max_tokens": 128,
                                                "kv_type": kv_type}))
        (d / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs if r["method"] == method))
    return root


def _script(*args: str | Path) -> subprocess.CompletedProcess:
    """``pask-local study kv-bytes ARGS`` through the installed console script."""
    return run_cli("study", "kv-bytes", *map(str, args), timeout=300)


def test_kv_bytes_shares_against_the_gguf_shape(tmp_path, qwen05_path):
    cell = _cell_bytes(qwen05_path)
    prompts = {"c0": 254, "c1": 500}  # Full f16 cells: 383 -> 512, 629 -> 768
    f16 = _write_study(tmp_path / "f16", "f16", [_rec(c, "full", None, n) for c, n in prompts.items()]
                       + [_rec(c, "pask-hybrid", 0.33, n, alloc=int(256 * cell["f16"]), align=int(100 * cell["f16"]))
                          for c, n in prompts.items()])
    # Full KV q8_0 right on both cases: retention is against Full f16 (one of two right), not Full q8_0
    q8 = _write_study(tmp_path / "q8", "q8_0", [_rec(c, "full", None, n, valid=True) for c, n in prompts.items()]
                      + [_rec(c, "pask-hybrid", 0.33, n, alloc=int(256 * cell["q8_0"]), align=0)
                         for c, n in prompts.items()])
    out = tmp_path / "kv"
    r = _script("--gguf", qwen05_path, f16, q8, "--out", out)
    assert r.returncode == 0, r.stderr
    rows = {(x["label"], x["kv_type"]): x for x in json.loads(out.with_suffix(".json").read_text())["runs"]}
    full_alloc = (512 + 768) * cell["f16"]
    full_cells = (383 + 629) * cell["f16"]
    assert rows[("full", "f16")]["share_of_full_f16"] == pytest.approx(1.0)
    assert rows[("full", "q8_0")]["share_of_full_f16"] == pytest.approx(34 / 64)
    assert rows[("full", "q8_0")]["share_before_rounding"] == pytest.approx(34 / 64)
    hy16, hy8 = rows[("pask-hybrid@0.33", "f16")], rows[("pask-hybrid@0.33", "q8_0")]
    assert hy16["share_of_full_f16"] == pytest.approx(512 * cell["f16"] / full_alloc, rel=1e-6)
    assert hy16["share_before_rounding"] == pytest.approx(312 * cell["f16"] / full_cells, rel=1e-6)
    assert hy8["mean_bytes"] == pytest.approx(256 * cell["q8_0"], abs=1)
    assert hy8["share_of_full_f16"] == pytest.approx(512 * cell["q8_0"] / full_alloc, rel=1e-6)
    assert hy8["share_before_rounding"] == pytest.approx(512 * cell["q8_0"] / full_cells, rel=1e-6)
    # held: (254 + 20) x 0.25 + (500 + 20) x 0.5 of the 794 entries (the last generated token is never
    # cached), at q8_0's bytes per entry
    held = (274 * 0.25 + 520 * 0.5) / 794
    assert hy16["held_share_of_full_f16"] == pytest.approx(held)
    assert hy8["held_share_of_full_f16"] == pytest.approx(held * 34 / 64)
    assert rows[("full", "q8_0")]["held_share_of_full_f16"] == pytest.approx(34 / 64)
    assert hy8["accuracy"] == pytest.approx(0.5) and hy8["retention_of_full_f16"] == pytest.approx(1.0)
    assert rows[("full", "q8_0")]["retention_of_full_f16"] == pytest.approx(2.0)
    assert "| pask-hybrid@0.33 | q8_0 | 2 |" in r.stdout


def test_bad_records_are_study_errors():
    recs = {("c0", "snapkv", "0.2"): _rec("c0", "snapkv", 0.2, 100)}
    with pytest.raises(StudyError, match="snapkv@0.2: case c0 recorded no K/V bytes"):
        kv_bytes(recs, ["c0"], "f16", lambda n, t: 10 * n, 128)
    recs[("c0", "snapkv", "0.2")] = _rec("c0", "snapkv", 0.2, 100, alloc=2560)
    assert kv_bytes(recs, ["c0"], "f16", lambda n, t: 10 * n, 128)[0]["share_of_full_f16"] == pytest.approx(1.0)
    # a run from a shared prefill recorded its part of one stream: no allocation, the held share kept
    recs[("c0", "snapkv", "0.2")]["stats"] |= {"shared_prefill": 3, "budget_used_final": 0.2}
    (row,) = kv_bytes(recs, ["c0"], "f16", lambda n, t: 10 * n, 128)
    assert (row["share_of_full_f16"], row["mean_bytes"], row["held_share_of_full_f16"]) == (None, None, 0.2)
    with pytest.raises(StudyError, match="snapkv@0.2 has no record of case c9"):
        kv_bytes(recs, ["c0", "c9"], "f16", lambda n, t: 10 * n, 128)
    recs[("c0", "snapkv", "0.2")]["stats"]["budget_used_final"] = None
    with pytest.raises(StudyError, match="recorded no final K/V share"):
        kv_bytes(recs, ["c0"], "f16", lambda n, t: 10 * n, 128)
    recs[("c0", "snapkv", "0.2")] = {**_rec("c0", "snapkv", 0.2, 0), "error_type": "generation_error", "error": "x"}
    with pytest.raises(StudyError, match="failed to generate"):
        kv_bytes(recs, ["c0"], "f16", lambda n, t: 10 * n, 128)


def test_kv_bytes_errors_are_one_line(tmp_path, qwen05_path):
    def one_line(r: subprocess.CompletedProcess, text: str) -> None:
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and text in r.stderr, r.stderr

    one_line(_script(tmp_path, "--out", tmp_path / "kv"), "holds no eval output directory")
    a = _write_study(tmp_path / "a", "f16", [_rec("c0", "full", None, 100), _rec("c0", "snapkv", 0.2, 100)])
    b = _write_study(tmp_path / "b", "f16", [_rec("c0", "full", None, 100)])
    one_line(_script(a, b, "--out", tmp_path / "kv"), "two studies have the same K/V type")
    c = _write_study(tmp_path / "c", "q8_0", [_rec("c0", "full", None, 100)], model="other.gguf")
    one_line(_script(a, c, "--out", tmp_path / "kv"), "was run with other settings")
    one_line(_script(a, "--out", tmp_path / "kv"), "the studies' model m.gguf is not here")
    one_line(_script("--gguf", qwen05_path, a, "--out", tmp_path / "kv"), "snapkv@0.2: case c0 recorded no K/V bytes")
    (tmp_path / "file").write_text("")
    d = _write_study(tmp_path / "d", "f16", [_rec("c0", "full", None, 100)])
    one_line(_script("--gguf", qwen05_path, d, "--out", tmp_path / "file" / "kv"), "error:")
    assert not (tmp_path / "kv.json").exists()


def test_round_up():
    assert (round_up(383, 256), round_up(512, 256), round_up(1, 256)) == (512, 512, 256)
