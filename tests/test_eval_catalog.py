"""Catalog workloads: grouping, the seeded distractor draw, the token target, the shared prefix, bad input.

The construction is pure (``eval.catalog``); most tests count tokens with a stand-in that is exact
arithmetic on the JSON (no model), the last ones with Qwen2.5's own tokenizer and template.
"""

from __future__ import annotations

import json

import pytest

from pask_local.eval.catalog import (
    CatalogError,
    apply_catalogs,
    build_catalog,
    function_key,
    gold_positions,
    group_cases,
)
from pask_local.eval.data import CATEGORIES, load_cases
from pask_local.eval.split import select


def chars_count(functions: list[dict]) -> int:
    """A deterministic token count: a fixed header plus one token per 4 characters of each function's JSON."""
    return 30 + sum(len(json.dumps(f)) // 4 + 3 for f in functions)


@pytest.fixture(scope="module")
def pool():
    return select(load_cases(list(CATEGORIES)), "eval")


def _names(functions):
    return [f["name"] for f in functions]


def test_groups_are_consecutive_and_never_hold_one_name_twice(pool):
    groups = group_cases(pool, 5)
    for cat in CATEGORIES:
        mine = [g for g in groups if g.category == cat]
        assert [g.index for g in mine] == list(range(len(mine)))
        ids = [c.id for g in mine for c in g.cases]
        assert sorted(ids) == sorted(c.id for c in pool if c.category == cat)  # every case, once
    for g in groups:
        assert 1 <= len(g.cases) <= 5
        by_name: dict[str, str] = {}
        for c in g.cases:
            for f in c.functions:
                assert by_name.setdefault(f["name"], function_key(f)) == function_key(f), g.name
    # the first groups of a category are its first cases when nothing conflicts (parallel_multiple: none)
    pm = [c.id for c in pool if c.category == "parallel_multiple"]
    assert [c.id for c in groups[[g.category for g in groups].index("parallel_multiple")].cases] == pm[:5]


def test_catalog_is_deterministic_by_seed_and_holds_the_group(pool):
    group = next(g for g in group_cases(pool, 5) if g.category == "multiple")
    a = build_catalog(group, pool, 4000, chars_count, seed=3)
    b = build_catalog(group, pool, 4000, chars_count, seed=3)
    c = build_catalog(group, pool, 4000, chars_count, seed=4)
    assert a.functions == b.functions and a.seed == b.seed and a.tokens == b.tokens
    assert _names(a.functions) != _names(c.functions) and a.seed != c.seed
    keys = {function_key(f) for f in a.functions}
    for case in group.cases:
        assert all(function_key(f) in keys for f in case.functions)   # every case's own functions
    names = _names(a.functions)
    assert len(names) == len(set(names))                               # no exact-name collisions
    assert a.n_distractors == len(a.functions) - len({function_key(f) for c in group.cases for f in c.functions})
    assert a.n_distractors > 10
    mine = {c.id for c in group.cases}
    others = {function_key(f) for c in pool if c.id not in mine for f in c.functions}
    assert all(function_key(f) in others for f in a.functions if f["name"] not in
               {g["name"] for c in group.cases for g in c.functions})  # distractors: other cases' functions


@pytest.mark.parametrize("target", [1500, 4000, 12000])
def test_token_target_is_met_within_the_tolerance(pool, target):
    for group in group_cases(pool, 5)[:40:13]:
        cat = build_catalog(group, pool, target, chars_count, seed=0, tolerance=0.05)
        assert abs(cat.tokens - target) <= 0.05 * target, (group.name, cat.tokens)
        assert cat.tokens == chars_count(cat.functions)


def test_every_case_of_a_group_gets_the_same_catalog_and_its_gold_positions(pool):
    selected = [c for c in pool if c.category in ("parallel", "live_multiple")][:12]
    out = apply_catalogs(selected, pool, 3000, chars_count, group_size=4, seed=1)
    assert sorted(c.id for c in out) == sorted(c.id for c in selected)
    by_group: dict[str, list] = {}
    for c in out:
        by_group.setdefault(c.meta["group"], []).append(c)
        assert c.functions == next(s for s in selected if s.id == c.id).functions  # the checker's view unchanged
        for pos, call in zip(c.meta["gold_positions"], c.answer, strict=True):
            assert c.tools[pos]["name"] == next(iter(call))
        assert gold_positions(c, c.tools) == c.meta["gold_positions"]
    for cases in by_group.values():
        assert all(c.tools == cases[0].tools and c.meta["seed"] == cases[0].meta["seed"] for c in cases)
    # a group's cases run back to back (their prefix is shared)
    order = [c.meta["group"] for c in out]
    assert all(order.index(g) + len(v) - 1 == len(order) - 1 - order[::-1].index(g) for g, v in by_group.items())
    # a shorter selection (--limit) gets the same catalogs for the cases it keeps
    fewer = apply_catalogs(selected[:3], pool, 3000, chars_count, group_size=4, seed=1)
    assert all(c.tools == next(o for o in out if o.id == c.id).tools for c in fewer)


def test_bad_targets_are_one_line(pool):
    group = next(g for g in group_cases(pool, 5) if g.category == "live_multiple")
    with pytest.raises(CatalogError, match=r"smaller than group live_multiple/0's own functions") as exc:
        build_catalog(group, pool, 50, chars_count)
    assert "\n" not in str(exc.value)
    with pytest.raises(CatalogError, match="larger than the model's trained context"):
        apply_catalogs(pool[:1], pool, 40000, chars_count, n_ctx_train=32768)
    with pytest.raises(CatalogError, match="too few distinct functions"):
        build_catalog(group, pool[:30], 200000, chars_count)
    with pytest.raises(CatalogError, match="at least 1"):
        group_cases(pool, 0)


def test_qwen_catalog_prefix_is_shared_by_a_groups_cases(pool, qwen05_path):
    """With Qwen2.5's template and tokenizer: the target is met, and every case of a group renders
    the same system + tools prefix, its own user turn after it."""
    from pask_local.eval.prompting import make_task, prefix_counter, render_tokens
    from pask_local.llm import Model

    model = Model(qwen05_path)
    try:
        count = prefix_counter(model, "native", use_examples=False)
        selected = [c for c in pool if c.category == "simple_python"][:3]
        out = apply_catalogs(selected, pool, 2000, count, group_size=5)
        toks = [render_tokens(model, make_task(c, use_examples=False), "native") for c in out]
    finally:
        model.close()
    n = out[0].meta["catalog_tokens"]
    assert abs(n - 2000) <= 100 and len({c.meta["group"] for c in out}) == 1
    common = min(next((i for i, (x, y) in enumerate(zip(a, toks[0], strict=False)) if x != y), len(a))
                 for a in toks[1:])
    assert common >= n - 8  # all but the user turn's few tokens (count() renders an empty one)
    assert all(len(t) > common for t in toks)


@pytest.mark.slow
def test_eval_with_a_catalog_records_it_and_resumes(tmp_path, qwen05_path):
    """End to end on Qwen2.5-Coder-0.5B: two cases of one group share the catalog (Full KV reuses its
    prefill from the first case), records and run.json note the catalog, a resume keeps every case."""
    import io

    from rich.console import Console

    from pask_local.eval.runner import EvalConfig, run_eval

    out = tmp_path / "res"
    cfg = EvalConfig(gguf=qwen05_path, out=out, methods=["full"], categories=["simple_python"], limit=2,
                     max_tokens=24, use_examples=False, prompt_style="native", catalog_tokens=800)
    store, cases, runs = run_eval(cfg, Console(file=io.StringIO()))
    assert len(store.records) == 2
    recs = [store.records[(c.id, "full", "full")] for c in cases]
    assert recs[0]["catalog"]["group"] == recs[1]["catalog"]["group"] == "simple_python/0"
    assert abs(recs[0]["catalog"]["catalog_tokens"] - 800) <= 40
    assert recs[1]["n_reused"] >= recs[0]["catalog"]["catalog_tokens"] - 8  # the catalog was prefilled once
    assert all(r["error_type"] != "generation_error" for r in store.records.values())
    notes = json.loads((out / "run.json").read_text())
    assert notes["catalog"] == {"tokens": 800, "group": 5, "seed": 0}
    assert notes["catalog_cases"][cases[0].id] == recs[0]["catalog"]

    def no_generation(method, spec):
        raise AssertionError(f"a finished case was generated again ({method})")

    again, _, _ = run_eval(cfg, Console(file=io.StringIO()), factory=no_generation)
    assert again.records == store.records
    more = EvalConfig(**{**cfg.__dict__, "limit": 3})
    grown, cases3, _ = run_eval(more, Console(file=io.StringIO()))
    assert len(cases3) == 3 and all(grown.records[k] == v for k, v in store.records.items())


@pytest.mark.slow
def test_cli_bad_catalog_tokens_is_one_line(tmp_path, qwen05_path, cli):
    for tokens, msg in (("5", "is smaller than group live_multiple/0's own functions"),
                        ("100000", "is larger than the model's trained context (32768)"),
                        ("0", "--catalog-tokens must be positive")):
        r = cli("eval", "--gguf", str(qwen05_path), "--catalog-tokens", tokens, "--categories", "live_multiple",
                "--limit", "1", "--out", str(tmp_path / tokens), env={"PASK_THREADS": "1"})
        assert r.returncode != 0 and msg in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / tokens / "run.json").exists()  # nothing pinned: a corrected rerun is not refused
