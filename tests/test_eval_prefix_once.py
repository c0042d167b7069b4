"""``pask-local eval --methods once:M``: a catalog's prefix compressed once, every case of its group from it.

Real eval on Gemma 3 270M (the plain instruction prompt): two cases share one catalog group, so the
prefix is compressed once (its time recorded on the first case only) and both cases start from a
restored copy of it (``n_reused`` = the prefix's tokens, budget held over it). A query-aware method
cannot be compressed once: one line, exit 1.
"""

from __future__ import annotations

import dataclasses
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


@pytest.mark.slow
def test_whole_prefill_is_pinned_and_a_policy_reaches_once_pask(tmp_path, cli):
    """``--whole-prefill`` is pinned in run.json (resuming without it is refused in one line), and
    ``--policy`` reaches ``once:pask``: with the hand-written prior as its file it compresses and
    answers exactly as ``once:pask-prior`` does, from the one whole prefill of the catalog they share."""
    from pask_local.policy.handwritten import handwritten_policy

    prior = tmp_path / "prior.json"
    handwritten_policy(18).save(prior)
    out = tmp_path / "ev"
    args = ["eval", "--model", "gemma3-270m", "--categories", "simple_python", "--limit", "2", "--budgets", "0.33",
            "--catalog-tokens", "700", "--max-tokens", "16", "--out", str(out)]
    r = cli(*args, "--methods", "once:pask,once:pask-prior", "--policy", str(prior), "--whole-prefill",
            env={"PASK_THREADS": "2"})
    assert r.returncode == 0, r.stderr
    recs = _records(out)

    def runs(method):
        return [(x["id"], x["output"], x["stats"]["prefix_held_share"]) for x in recs if x["method"] == method]

    assert len(runs("once:pask")) == 2 and runs("once:pask") == runs("once:pask-prior")
    # one catalog group: its whole prefill is paid by the first run and restored by the second
    paid = {(x["method"], x["stats"]["whole_prefill_shared"], x["stats"]["whole_prefill_s"] > 0) for x in recs
            if x["stats"]["prefix_compress_s"] > 0}
    assert paid == {("once:pask", False, True), ("once:pask-prior", True, False)}
    assert json.loads((out / "run.json").read_text())["whole_prefill"] is True
    again = cli(*args, "--methods", "once:pask", "--policy", str(prior))
    assert again.returncode == 1 and "different settings (whole_prefill)" in again.stderr
    assert "Traceback" not in again.stderr


def _catalog_cases(gguf):
    """Two eval-split simple_python cases behind one ~900-token catalog (native prompt, no examples),
    and the model's layer count."""
    from pask_local.eval.catalog import apply_catalogs
    from pask_local.eval.data import load_bundled
    from pask_local.eval.prompting import prefix_counter
    from pask_local.eval.split import split_of
    from pask_local.llm import Model

    pool = [c for c in load_bundled("simple_python") if split_of(c.id) == "eval"]
    model = Model(gguf)
    try:
        return apply_catalogs(pool[:2], pool, 900, prefix_counter(model, "native", False)), model.n_layer
    finally:
        model.close()


@pytest.mark.slow
def test_a_whole_prompt_method_prefills_each_catalog_once(qwen05_path):
    """SnapKV on a catalog group: the catalog is prefilled once, held whole, and every case reads its
    own question on a copy of it, then compresses as a run of its own does: the same peak (the whole
    prompt held) and budget as the case run alone from a fresh prefill."""
    from pask_local.eval.generator import EngineGenerator, GeneratorSpec
    from pask_local.eval.prefix_once import SharedCatalogGenerator
    from pask_local.prefix.whole import WholePrefills

    cases, _ = _catalog_cases(qwen05_path)
    held = WholePrefills()
    spec = GeneratorSpec(qwen05_path, 0.33, max_tokens=32, use_examples=False, prompt_style="native",
                         shared_catalog=True, whole_prefills=held)
    at_02 = dataclasses.replace(spec, budget=0.2)
    gens = [SharedCatalogGenerator("snapkv", spec), EngineGenerator("snapkv", spec),
            SharedCatalogGenerator("snapkv", at_02), SharedCatalogGenerator("snapkv", dataclasses.replace(at_02, whole_prefills=None))]
    try:
        outs = [gens[0].generate(c) for c in cases]
        ref = gens[1].generate(cases[1])
        # another budget's run restores the same whole prefill, and answers as with a prefill of its own
        again, own = gens[2].generate(cases[1]), gens[3].generate(cases[1])
    finally:
        for g in gens:
            g.close()
    assert held.prefills == 1 and again.extra["prefix_prefill_shared"] and again.extra["prefix_prefill_s"] == 0
    assert own.extra["prefix_prefill_s"] > 0 and not own.extra["prefix_prefill_shared"]
    assert again.text == own.text and again.error is None
    assert again.extra["budget_used_after_prefill"] <= 0.2 + 0.01
    n = outs[0].extra["prefix_tokens"]
    assert n > 700 and outs[0].n_reused == outs[1].n_reused == n
    assert outs[0].extra["prefix_prefill_s"] > 0 and outs[1].extra["prefix_prefill_s"] == 0  # once per group
    assert outs[1].extra["prefix_source"] == "prefix"
    assert outs[1].extra["peak_prefill_entries"] == ref.extra["peak_prefill_entries"]  # held whole, then compressed
    assert outs[1].extra["budget_used_after_prefill"] <= 0.33 + 0.01
    assert outs[1].error is None and ref.error is None


@pytest.mark.slow
def test_a_planned_method_per_query_reads_each_catalog_once_under_whole_prefill(qwen05_path):
    """``--whole-prefill``: pask-prior per query on a catalog group restores the group's prefix prefilled
    whole (once, for both budgets), reads its own question, then drops what its plan, made on the whole
    prompt, does not keep: the whole prompt is held before the drop, the budget after it. A method with
    a scoring pass (knorm) reads each prompt itself, with no whole-prefill holder built for it."""
    from pask_local.eval.generator import EngineGenerator, GeneratorSpec, make_generator
    from pask_local.eval.prefix_once import SharedCatalogGenerator
    from pask_local.prefix.whole import WholePrefills

    cases, n_layer = _catalog_cases(qwen05_path)
    held = WholePrefills()
    spec = GeneratorSpec(qwen05_path, 0.33, max_tokens=32, use_examples=False, prompt_style="native",
                         shared_catalog=True, whole_prefill=True, whole_prefills=held)
    gens = [make_generator("pask-prior", spec), make_generator("pask-prior", dataclasses.replace(spec, budget=0.2)),
            make_generator("knorm", spec)]
    try:
        outs = [gens[0].generate(c) for c in cases]
        at_02, scored = gens[1].generate(cases[1]), gens[2].generate(cases[1])
    finally:
        for g in gens:
            g.close()
    assert isinstance(gens[0], SharedCatalogGenerator) and held.prefills == 1
    assert type(gens[2]) is EngineGenerator
    n = outs[0].extra["prefix_tokens"]
    assert n > 700 and outs[0].n_reused == outs[1].n_reused == at_02.n_reused == n
    assert at_02.extra["prefix_prefill_shared"] and at_02.extra["prefix_prefill_s"] == 0
    for out, budget in ((outs[1], 0.33), (at_02, 0.2)):
        assert out.error is None and out.extra["peak_prefill_entries"] == out.n_prompt * n_layer
        assert out.extra["budget_used_after_prefill"] <= budget + 0.01
    assert scored.error is None and scored.n_reused == 0 and "prefix_tokens" not in scored.extra
