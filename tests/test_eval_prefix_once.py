"""``pask-local eval --methods once:M``: a catalog's prefix compressed once, every case of its group from it.

Real eval on Gemma 3 270M (the plain instruction prompt): two cases share one catalog group, so the
prefix is compressed once (its time recorded on the first case only) and both cases start from a
restored copy of it (``n_reused`` = the prefix's tokens, budget held over it). A query-aware method
cannot be compressed once: one line, exit 1.
"""

from __future__ import annotations

import json

import pytest


def _records(out):
    return [json.loads(line) for line in (out / "cases.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_once_compresses_each_catalog_prefix_once(tmp_path, cli):
    out = tmp_path / "ev"
    r = cli("eval", "--model", "gemma3-270m", "--categories", "simple_python", "--limit", "2",
            "--methods", "once:pask-prior,once:full", "--budgets", "0.33", "--catalog-tokens", "700",
            "--max-tokens", "24", "--out", str(out), env={"PASK_THREADS": "2"})
    assert r.returncode == 0, r.stderr
    recs = _records(out)
    assert sorted({(x["method"], x["budget"]) for x in recs}) == [("once:full", None), ("once:pask-prior", 0.33)]
    for method in ("once:pask-prior", "once:full"):
        mine = [x for x in recs if x["method"] == method]
        assert len(mine) == 2
        first, second = mine
        n_prefix = first["stats"]["prefix_tokens"]
        assert 500 < n_prefix < first["n_prompt"]  # the catalog is the shared prefix; the question follows
        assert first["n_reused"] == second["n_reused"] == n_prefix == second["stats"]["prefix_tokens"]
        assert first["stats"]["prefix_compress_s"] > 0 and second["stats"]["prefix_compress_s"] == 0
        assert first["stats"]["prefix_source"] == "prefix"
        share = first["stats"]["prefix_held_share"]  # of prefix tokens x layers
        if method == "once:full":
            assert share == 1.0
        else:  # Gemma's sliding-window layers hold at most their window, so the share of all positions is lower
            assert 0.2 <= share <= 0.34


def test_once_refuses_a_query_aware_method(tmp_path, cli):
    r = cli("eval", "--model", "gemma3-270m", "--categories", "simple_python", "--limit", "1",
            "--methods", "once:snapkv", "--out", str(tmp_path / "ev"))
    assert r.returncode == 1 and "unknown method 'once:snapkv'" in r.stderr and "Traceback" not in r.stderr
