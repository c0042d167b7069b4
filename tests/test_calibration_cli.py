"""``calibrate_command`` end to end on a synthetic GGUF (random weights: the numbers mean nothing,
the pipeline does): real BFCL calib cases, real tokenizer and grammar, the resumable cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pask_local.calibration.cli import CalibrationError, calib_cases, calibrate_command
from pask_local.calibration.synthetic import write_synthetic_gguf

from pask_local.classes import StructuralClass
from pask_local.errors import PaskError
from pask_local.eval.split import split_of
from pask_local.policy.schema import Policy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("cal") / "g.gguf", arch="gemma3", seed=1)


def run(synth, out, n, **kw):
    return calibrate_command(synth, ["simple_python", "multiple"], n, out, groups=2, max_tokens=4000,
                             quiet=True, **kw)


def measured_lines(cache):
    return [json.loads(x) for x in cache.read_text().splitlines() if x.strip() and "cells" in json.loads(x)]


def test_cases_come_from_the_calib_split_round_robin():
    cases = calib_cases(["simple_python", "multiple"])
    assert cases and all(split_of(c.id) == "calib" for c in cases)
    assert [c.category for c in cases[:4]] == ["simple_python", "multiple"] * 2
    assert [c.id for c in calib_cases(["simple_python", "multiple"])] == [c.id for c in cases]


@pytest.mark.slow
def test_calibrate_writes_a_policy_and_resumes_from_its_cache(synth, tmp_path):
    out = tmp_path / "policy.json"
    cache = tmp_path / "policy.cases.jsonl"
    pol = run(synth, out, 1)
    first = measured_lines(cache)
    assert len(first) == 1 and first[0]["id"] == calib_cases(["simple_python"])[0].id
    assert pol.kind == "calibrated" and pol.provenance["n_cases"] == 1 and pol.provenance["split"] == "calib"
    loaded = Policy.load(out)
    assert loaded.groups == [[0, 1], [2, 3]] and loaded.provenance["model_sha256"] == pol.provenance["model_sha256"]

    # plant a marker in the cached measurement: a resumed run must use it instead of measuring again
    lines = cache.read_text().splitlines()
    rec = json.loads(lines[0])
    rec["cells"][0]["dnll"] = 42.0
    cache.write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n")
    marked = (rec["cells"][0]["group"], rec["cells"][0]["class"])

    pol2 = run(synth, out, 2)
    second = measured_lines(cache)
    assert [r["id"] for r in second[:1]] == [first[0]["id"]] and len(second) == 2
    assert second[1]["category"] == "multiple"                       # round-robin over categories
    meas = {(m["group"], m["class"]): m for m in pol2.provenance["measurements"]}
    other = [c["dnll"] for c in second[1]["cells"] if (c["group"], c["class"]) == marked]
    assert meas[marked]["n_cases"] == 1 + len(other)
    assert meas[marked]["dnll_mean"] == pytest.approx((42.0 + sum(other)) / (1 + len(other)), abs=1e-4)
    assert pol2.provenance["n_cases"] == 2

    # a run cut mid-line leaves a partial last line: it is ignored and measured again
    with cache.open("a") as f:
        f.write('{"id": "simple_py')
    pol3 = run(synth, out, 2)
    assert pol3.provenance["n_cases"] == 2

    # the cache belongs to its settings: other groups are refused with one line
    with pytest.raises(CalibrationError, match="other settings"):
        calibrate_command(synth, ["simple_python"], 1, out, groups=3, max_tokens=4000, quiet=True)


@pytest.mark.parametrize("kwargs, match", [
    ({"cases": 0}, "--cases"),
    ({"categories": ["nope"]}, "unknown category"),
    ({"out_name": "policy.txt"}, ".json"),
    ({"dtype": "float64"}, "--dtype"),
    ({"signal": "torch"}, "--signal"),
    ({"keep": 0.2}, "--keep needs --signal native"),
    ({"signal": "native", "keep": 1.0}, "--keep must be in"),
    ({"group_curves": True}, "--group-curves needs --signal native"),
    ({"catalog_tokens": -1}, "--catalog-tokens must be"),
    ({"catalog_tokens": 5000, "max_tokens": 4000}, "needs --max-tokens above it"),
])
def test_bad_input_is_a_one_line_error(synth, tmp_path, kwargs, match):
    out = tmp_path / kwargs.pop("out_name", "p.json")
    args = {"categories": ["simple_python"], "cases": 1, **kwargs}
    with pytest.raises(PaskError, match=match) as info:
        calibrate_command(synth, args.pop("categories"), args.pop("cases"), out, quiet=True, **args)
    assert "\n" not in str(info.value)


def test_missing_model_file_is_a_one_line_error(tmp_path):
    with pytest.raises(PaskError, match="not found"):
        calibrate_command(tmp_path / "missing.gguf", ["simple_python"], 1, tmp_path / "p.json", quiet=True)


def test_cache_without_joint_cells_gets_them_added(synth, tmp_path):
    out = tmp_path / "policy.json"
    cache = tmp_path / "policy.cases.jsonl"
    run(synth, out, 1)
    rec = measured_lines(cache)[0]
    assert rec["joint"] and run(synth, out, 1).provenance["floor_signal"] == "joint"
    # a cache line from before joint cells existed, with a marker in its per-group cells
    old = {k: v for k, v in rec.items() if k != "joint"}
    old["cells"][0]["dnll"] = 42.0
    cache.write_text(json.dumps(old) + "\n")
    pol = run(synth, out, 1)
    lines = [json.loads(x) for x in cache.read_text().splitlines()]
    assert len(lines) == 2 and "joint" not in lines[0]          # the upgraded record is appended
    assert lines[1]["cells"][0]["dnll"] == 42.0                 # per-group cells kept, not re-measured
    assert [j["class"] for j in lines[1]["joint"]] == [j["class"] for j in rec["joint"]]
    assert [j["dnll"] for j in lines[1]["joint"]] == pytest.approx([j["dnll"] for j in rec["joint"]])
    assert pol.provenance["floor_signal"] == "joint"


@pytest.mark.parametrize("arch", ["qwen2", "llama", "phi3"])
def test_calibrate_runs_on_other_attention_architectures(tmp_path, arch):
    """The reference learns qwen2 / llama / phi3: calibration measures every (group, class) cell."""
    path = write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch=arch, seed=3, n_ctx=4096)
    pol = calibrate_command(path, ["simple_python"], 1, tmp_path / "p.json", groups=2, max_tokens=4000, quiet=True)
    assert pol.kind == "calibrated" and pol.provenance["n_cases"] == 1 and pol.groups == [[0, 1], [2, 3]]
    meas = pol.provenance["measurements"]
    assert meas and {m["group"] for m in meas} == {0, 1}
    assert all(np.isfinite(m["dnll_mean"]) for m in meas)


def test_native_signal_writes_a_policy_weighted_by_dnll_and_keeps_its_own_cache(synth, tmp_path):
    out = tmp_path / "native.json"
    pol = run(synth, out, 1, signal="native", keep=0.25)
    (rec,) = measured_lines(tmp_path / "native.cases.jsonl")
    assert rec["signal"] == "native" and rec["keep"] == 0.25
    assert rec["settings"]["signal"] == "native" and "chunk" not in rec["settings"]
    assert rec["cells"] and all(c["distortion"] is None for c in rec["cells"])
    assert not any(c["class"].startswith("gen_") for c in rec["cells"])  # the call is kept by the engine
    assert pol.provenance["weight_signal"] == "dnll per evicted token" and pol.provenance["keep"] == 0.25
    assert "--signal native --keep 0.25" in pol.provenance["command"]
    # the weights follow the NLL increase per evicted token (at least min_weight)
    per_token = {(c["group"], c["class"]): max(0.0, c["dnll"]) / c["n_evicted"] for c in rec["cells"]}
    top = max(per_token.values())
    for (g, name), v in per_token.items():
        if top > 0:
            assert pol.weights[g][StructuralClass(name)] == pytest.approx(max(0.02, v / top), abs=1e-4)
    # a reference-signal run may not reuse the native cache
    with pytest.raises(CalibrationError, match="other settings"):
        run(synth, out, 1)


def test_group_curves_are_measured_for_cached_cases_and_split_the_budget(synth, tmp_path):
    """--group-curves adds, to cases already measured, each group's NLL increase at every level (the
    prior's keep set in that group only), and the policy carries their means as its group_budget."""
    from pask_local.calibration.native_signals import GROUP_LEVELS

    from pask_local.policy.compile import compile_policy

    out = tmp_path / "g.json"
    run(synth, out, 2, signal="native", keep=0.2)
    cache = tmp_path / "g.cases.jsonl"
    assert not any("group_curves" in r for r in measured_lines(cache))
    pol = run(synth, out, 2, signal="native", keep=0.2, group_curves=True)
    latest = {r["id"]: r for r in measured_lines(cache)}
    assert len(latest) == 2 and all(len(r["group_curves"]) == 2 * len(GROUP_LEVELS) for r in latest.values())
    assert pol.group_budget is not None and pol.group_budget.levels == GROUP_LEVELS
    for g in range(2):
        for i, k in enumerate(GROUP_LEVELS):
            cells = [c["dnll"] for r in latest.values() for c in r["group_curves"] if c["group"] == g and c["keep"] == k]
            assert pol.group_budget.dnll[g][i] == pytest.approx(sum(cells) / len(cells))
    assert pol.provenance["group_budget"]["n_cases"] == 2
    assert Policy.load(out).group_budget == pol.group_budget
    # the compiled capacities follow the curves (equal curves would give equal capacities)
    comp = compile_policy(pol, 0.2, {StructuralClass.QUERY: 50, StructuralClass.DESCRIPTION: 150})
    assert sum(comp.layer_capacity) == pytest.approx(0.2 * 200 * sum(len(g) for g in pol.groups), rel=0.05)


def test_catalog_workload_calibrates_on_the_cases_eval_builds(synth, tmp_path):
    """--catalog-tokens: each measured case sits behind the catalog `eval --catalog-tokens` gives it
    (same grouping, distractors from the calib split, same seed), and the cache and policy say so."""
    from pask_local.calibration.cli import catalog_pool

    from pask_local.eval.catalog import apply_catalogs
    from pask_local.eval.data import CATEGORIES, load_bundled
    from pask_local.eval.prompting import prefix_counter
    from pask_local.eval.split import select
    from pask_local.llm import Model

    long_ctx = write_synthetic_gguf(tmp_path / "long.gguf", arch="gemma3", seed=1, n_ctx=16384)
    out = tmp_path / "p.json"
    policy = calibrate_command(long_ctx, ["simple_python"], 2, out, groups=2, max_tokens=9000,
                               quiet=True, signal="native", catalog_tokens=6000)
    assert "--catalog-tokens 6000" in policy.provenance["command"]
    lines = measured_lines(out.with_suffix(".cases.jsonl"))
    assert len(lines) == 2 and all(r["settings"]["catalog_tokens"] == 6000 for r in lines)
    assert all(r["n_prompt"] > 5000 for r in lines)  # byte tokens: a case's own tools are ~1-2k
    model = Model(long_ctx)
    try:
        pool = calib_cases(["simple_python"])
        ours = catalog_pool(model, pool, 2, 6000, "plain", True)
        split = [c for cat in CATEGORIES for c in select(load_bundled(cat), "calib")]
        evals = apply_catalogs(pool[:2], split, 6000, prefix_counter(model, "plain", True))
    finally:
        model.close()
    assert [c.id for c in ours] == [c.id for c in evals]
    for a, b in zip(ours, evals, strict=True):
        assert [f["name"] for f in a.tools] == [f["name"] for f in b.tools] and len(a.tools) > 3
        assert a.meta["catalog_tokens"] >= 5400
