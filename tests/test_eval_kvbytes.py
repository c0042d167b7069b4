"""pask_local.eval.kvbytes and scripts/study_kv_bytes.py: K/V bytes against Full KV f16 for the same requests.

The oracle for llama.cpp's allocation is the GGUF's shape (layers x KV heads x head size x K and V)
times the element size (f16: 2 bytes; q8_0: 34 bytes per block of 32), read with the ``gguf``
package, not with pask-local.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from pask_local.eval.kvbytes import kv_bytes, round_up
from pask_local.eval.study import StudyError

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "study_kv_bytes.py"


def _cell_bytes(gguf: Path) -> dict[str, float]:
    """Bytes of one cell over all layers, K and V, per element type, from the GGUF's metadata."""
    r = GGUFReader(gguf)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def val(key: str) -> int:
        return int(r.fields[f"{arch}.{key}"].parts[-1][0])

    elems = val("block_count") * val("attention.head_count_kv") * (val("embedding_length") // val("attention.head_count"))
    return {"f16": 2 * elems * 2, "q8_0": 2 * elems * 34 / 32}


def _rec(case: str, method: str, budget: float | None, n_prompt: int, alloc: int | None = None, align: int = 0) -> dict:
    stats = {"n_prompt": n_prompt}
    if alloc is not None:
        stats |= {"kv_bytes_allocated": alloc, "kv_bytes_alignment": align, "n_gen": 20,
                  "budget_used_final": 0.25 if case == "c0" else 0.5}
    return {"id": case, "category": "simple", "method": method, "budget": budget, "valid": case != "c1",
            "output": "o", "seconds": 1.0, "stats": stats}


def _write_study(root: Path, kv_type: str, recs: list[dict]) -> Path:
    for method in {r["method"] for r in recs}:
        d = root / method
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"model": "m.gguf", "split": "eval", "max_tokens": 128,
                                                "kv_type": kv_type}))
        (d / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs if r["method"] == method))
    return root


def test_script_shares_against_the_gguf_shape(tmp_path, qwen05_path):
    cell = _cell_bytes(qwen05_path)
    prompts = {"c0": 254, "c1": 500}  # Full f16 cells: 383 -> 512, 629 -> 768
    f16 = _write_study(tmp_path / "f16", "f16", [_rec(c, "full", None, n) for c, n in prompts.items()]
                       + [_rec(c, "pask-hybrid", 0.33, n, alloc=int(256 * cell["f16"]), align=int(100 * cell["f16"]))
                          for c, n in prompts.items()])
    q8 = _write_study(tmp_path / "q8", "q8_0", [_rec(c, "full", None, n) for c, n in prompts.items()]
                      + [_rec(c, "pask-hybrid", 0.33, n, alloc=int(256 * cell["q8_0"]), align=0)
                         for c, n in prompts.items()])
    out = tmp_path / "kv"
    r = subprocess.run([sys.executable, str(SCRIPT), "--gguf", str(qwen05_path), str(f16), str(q8), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {(x["label"], x["kv_type"]): x for x in json.loads(out.with_suffix(".json").read_text())["runs"]}
    full_alloc = (512 + 768) * cell["f16"]
    full_cells = (383 + 629) * cell["f16"]
    assert rows[("full", "f16")]["share_of_full_f16"] == pytest.approx(1.0)
    assert rows[("full", "q8_0")]["share_of_full_f16"] == pytest.approx(34 / 64)
    assert rows[("pask-hybrid@0.33", "f16")]["share_of_full_f16"] == pytest.approx(512 * cell["f16"] / full_alloc, rel=1e-6)
    assert rows[("pask-hybrid@0.33", "f16")]["share_before_rounding"] == pytest.approx(312 * cell["f16"] / full_cells,
                                                                                      rel=1e-6)
    assert rows[("pask-hybrid@0.33", "q8_0")]["mean_bytes"] == pytest.approx(256 * cell["q8_0"], abs=1)
    assert rows[("pask-hybrid@0.33", "q8_0")]["share_of_full_f16"] == pytest.approx(512 * cell["q8_0"] / full_alloc,
                                                                                   rel=1e-6)
    # held at the end: (254 + 20) x 0.25 + (500 + 20) x 0.5 of the 794 entries, at q8_0's bytes per entry
    held = (274 * 0.25 + 520 * 0.5) / 794
    assert rows[("pask-hybrid@0.33", "f16")]["held_share_of_full_f16"] == pytest.approx(held)
    assert rows[("pask-hybrid@0.33", "q8_0")]["held_share_of_full_f16"] == pytest.approx(held * 34 / 64)
    assert rows[("full", "q8_0")]["held_share_of_full_f16"] == pytest.approx(34 / 64)
    # accuracy on the 2 cases (c1 wrong everywhere: 50%), retention against Full f16
    assert rows[("pask-hybrid@0.33", "q8_0")]["accuracy"] == pytest.approx(0.5)
    assert rows[("pask-hybrid@0.33", "q8_0")]["retention_of_full_f16"] == pytest.approx(1.0)
    assert "| pask-hybrid@0.33 | q8_0 | 2 |" in r.stdout


def test_missing_bytes_and_bad_directory_are_one_line_errors(tmp_path, qwen05_path):
    recs = {("c0", "snapkv", "0.2"): _rec("c0", "snapkv", 0.2, 100)}
    with pytest.raises(StudyError, match="snapkv@0.2: case c0 recorded no K/V bytes"):
        kv_bytes(recs, ["c0"], "f16", lambda n, t: 10 * n, 128)
    recs[("c0", "snapkv", "0.2")] = _rec("c0", "snapkv", 0.2, 100, alloc=2560)
    assert kv_bytes(recs, ["c0"], "f16", lambda n, t: 10 * n, 128)[0]["share_of_full_f16"] == pytest.approx(2560 / 2560)
    # a run from a shared prefill recorded its part of one stream: no allocation, the held share kept
    recs[("c0", "snapkv", "0.2")]["stats"] |= {"shared_prefill": 3, "budget_used_final": 0.2, "n_gen": 28}
    (row,) = kv_bytes(recs, ["c0"], "f16", lambda n, t: 10 * n, 128)
    assert (row["share_of_full_f16"], row["mean_bytes"], row["held_share_of_full_f16"]) == (None, None, 0.2)
    with pytest.raises(StudyError, match="snapkv@0.2 has no record of case c9"):
        kv_bytes(recs, ["c0", "c9"], "f16", lambda n, t: 10 * n, 128)
    r = subprocess.run([sys.executable, str(SCRIPT), "--gguf", str(qwen05_path), str(tmp_path), "--out",
                        str(tmp_path / "kv")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "holds no eval output directory" in r.stderr


def test_round_up():
    assert (round_up(383, 256), round_up(512, 256), round_up(1, 256)) == (512, 512, 256)
