"""The calibration / evaluation split: deterministic, disjoint, covering, about 25% calibration."""

from __future__ import annotations

import random

import pytest

from pask_local.errors import PaskError
from pask_local.eval.data import CATEGORIES, load_cases
from pask_local.eval.prompting import pick_examples
from pask_local.eval.split import CALIB_FRACTION, select, split_of


@pytest.fixture(scope="module")
def cases():
    return load_cases(list(CATEGORIES))


def test_split_is_deterministic_and_order_free(cases):
    ids = [c.id for c in cases]
    first = {i: split_of(i) for i in ids}
    shuffled = ids[:]
    random.Random(7).shuffle(shuffled)
    assert {i: split_of(i) for i in shuffled} == first
    assert [c.id for c in select(cases, "calib")] == [c.id for c in cases if first[c.id] == "calib"]


def test_split_is_disjoint_and_covering(cases):
    calib = {c.id for c in select(cases, "calib")}
    evals = {c.id for c in select(cases, "eval")}
    assert not calib & evals
    assert calib | evals == {c.id for c in cases}
    assert [c.id for c in select(cases, "all")] == [c.id for c in cases]


def test_split_fraction(cases):
    frac = len(select(cases, "calib")) / len(cases)
    assert abs(frac - CALIB_FRACTION) < 0.03, frac
    for cat in ("simple_python", "multiple", "live_multiple"):
        sub = [c for c in cases if c.category == cat]
        assert 0.15 < len(select(sub, "calib")) / len(sub) < 0.35


def test_split_depends_on_the_id():
    ids = [f"case_{i}" for i in range(400)]
    assert len({split_of(i) for i in ids}) == 2


def test_bad_split_name():
    with pytest.raises(PaskError):
        select([], "train")


def test_few_shot_examples_come_from_calib():
    examples = pick_examples()
    assert len(examples) >= 2
    assert all(split_of(e.id) == "calib" for e in examples)
    assert pick_examples() == examples
