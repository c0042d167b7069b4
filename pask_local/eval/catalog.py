"""Catalog workloads (``pask-local eval --catalog-tokens N``): many cases behind one long tool list.

An agent sends the same catalog of tools with every request. Here the cases of a category are
grouped (``group_size`` cases in split order); a group's catalog is the union of its cases' own
functions plus distractor functions from *other* cases of the same split (any category), drawn
with a recorded seed, shuffled, and filled to about ``N`` tokens of the model's rendered system +
tools prefix. Every case of a group sees that same prefix and only its own user turn after it.
The checker still scores against the case's own functions, so a call to a distractor is wrong.

Rules (each keeps the catalog a valid tool list and the workload reproducible):

- a catalog never holds two functions of one name: a case whose own function has the name of a
  *different* function already in an open group goes to the next group without that conflict
  (BFCL's live categories reuse names with other parameters); distractors with a name already in
  the catalog are skipped. Near-duplicates under other names stay (they are BFCL's own);
- groups form over the whole split of a category, so ``--limit`` picks the same groups and
  catalogs as a longer run (a resumed run keeps its finished cases);
- the group's seed is ``sha256("pask-catalog-v1:{seed}:{category}:{index}")``, so a group's draw
  depends on nothing else.

Everything here is pure: the token count of a prefix is a callable handed in (``count``).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import PaskError
from .data import Case

Function = dict[str, Any]
Counter = Callable[[list[Function]], int]

DEFAULT_GROUP_SIZE = 5
DEFAULT_TOLERANCE = 0.05   # a catalog lands within +-5% of the target (or the pool ran out: an error)


class CatalogError(PaskError):
    """A catalog cannot be built as asked (target too small or too large)."""


@dataclass(frozen=True)
class Group:
    category: str
    index: int                  # the group's number within its category
    cases: tuple[Case, ...]     # in split order

    @property
    def name(self) -> str:
        return f"{self.category}/{self.index}"


@dataclass(frozen=True)
class Catalog:
    group: Group
    seed: int
    functions: list[Function]   # shuffled: own functions and distractors
    tokens: int                 # tokens of the rendered prefix (``count``)
    n_distractors: int


def function_key(fn: Function) -> str:
    """A function's identity (its canonical JSON)."""
    return json.dumps(fn, sort_keys=True, ensure_ascii=False)


def _own(cases: Sequence[Case]) -> list[Function]:
    """The union of the cases' own functions, first occurrence first (identical copies once)."""
    seen: dict[str, Function] = {}
    for c in cases:
        for f in c.functions:
            seen.setdefault(function_key(f), f)
    return list(seen.values())


def _conflicts(case: Case, names: dict[str, str]) -> bool:
    return any(names.get(f["name"], function_key(f)) != function_key(f) for f in case.functions)


def group_cases(cases: Sequence[Case], size: int = DEFAULT_GROUP_SIZE) -> list[Group]:
    """Groups of ``size`` cases per category, in split order (first fit: a case goes to the first
    open group where none of its functions' names means another function)."""
    if size < 1:
        raise CatalogError(f"--catalog-group must be at least 1, got {size}")
    groups: list[Group] = []
    by_cat: dict[str, list[tuple[list[Case], dict[str, str]]]] = {}
    for case in cases:
        open_groups = by_cat.setdefault(case.category, [])
        slot = next((g for g in open_groups if len(g[0]) < size and not _conflicts(case, g[1])), None)
        if slot is None:
            slot = ([], {})
            open_groups.append(slot)
        slot[0].append(case)
        slot[1].update({f["name"]: function_key(f) for f in case.functions})
    for cat, slots in by_cat.items():
        groups += [Group(cat, i, tuple(members)) for i, (members, _) in enumerate(slots)]
    return groups


def group_seed(seed: int, category: str, index: int) -> int:
    digest = hashlib.sha256(f"pask-catalog-v1:{seed}:{category}:{index}".encode()).hexdigest()
    return int(digest[:12], 16)


def distractor_pool(group: Group, split_cases: Sequence[Case]) -> list[Function]:
    """Distinct functions of the split's other cases, in a fixed order (their canonical JSON)."""
    mine = {c.id for c in group.cases}
    pool = {function_key(f): f for c in split_cases if c.id not in mine for f in c.functions}
    return [pool[k] for k in sorted(pool)]


def build_catalog(group: Group, split_cases: Sequence[Case], target: int, count: Counter, seed: int = 0,
                  tolerance: float = DEFAULT_TOLERANCE) -> Catalog:
    """The group's catalog: own functions + distractors drawn until the prefix is ``target`` tokens
    (+-``tolerance``), shuffled. CatalogError when the own functions alone exceed the target or the
    pool runs out below it."""
    own = _own(group.cases)
    base = count(own)
    if base > target:
        raise CatalogError(f"--catalog-tokens {target} is smaller than group {group.name}'s own functions "
                           f"({base} tokens with {len(own)} function(s))")
    slack = max(1, int(target * tolerance))
    gseed = group_seed(seed, group.category, group.index)
    rng = random.Random(gseed)
    pool = distractor_pool(group, split_cases)
    rng.shuffle(pool)
    names = {f["name"] for f in own}
    # a function's own tokens: beside an anchor, so the template's tools header is not counted in
    anchor = own[0] if own else None
    alone = count([anchor]) if anchor else count([])
    chosen: list[Function] = []
    estimate = base
    for fn in pool:
        if estimate >= target - slack:
            break
        if fn["name"] in names:
            continue  # exact-name collision: two tools of one name are not a valid catalog
        cost = count([anchor, fn] if anchor else [fn]) - alone  # an estimate; the sum is re-measured below
        if estimate + cost > target + slack:
            continue  # too long for what is left to fill; a shorter one may fit
        chosen.append(fn)
        names.add(fn["name"])
        estimate += cost
        if estimate >= target - slack:
            estimate = count(own + chosen)  # the real prefix: separators and merges shift the sum
            while estimate > target + slack and chosen:
                names.discard(chosen.pop()["name"])
                estimate = count(own + chosen)
    functions = own + chosen
    rng.shuffle(functions)
    tokens = count(functions)
    if tokens < target - slack:
        raise CatalogError(f"group {group.name}: the split's other cases hold too few distinct functions to "
                           f"fill {target} tokens (reached {tokens})")
    return Catalog(group, gseed, functions, tokens, len(chosen))


def gold_positions(case: Case, functions: Sequence[Function]) -> list[int]:
    """Where the case's gold functions sit in the catalog (0-based), in answer order."""
    index = {f["name"]: i for i, f in enumerate(functions)}
    out = []
    for call in case.answer or []:
        for name in call:
            if name in index:
                out.append(index[name])
    return out


def case_meta(case: Case, cat: Catalog) -> dict[str, Any]:
    """What a case's record (and run.json) notes about its catalog."""
    return {"group": cat.group.name, "seed": cat.seed, "catalog_tokens": cat.tokens,
            "catalog_functions": len(cat.functions), "gold_positions": gold_positions(case, cat.functions)}


def apply_catalogs(selected: Sequence[Case], split_cases: Sequence[Case], target: int, count: Counter,
                   group_size: int = DEFAULT_GROUP_SIZE, seed: int = 0, tolerance: float = DEFAULT_TOLERANCE,
                   n_ctx_train: int | None = None) -> list[Case]:
    """``selected`` (a subset of ``split_cases``, in any order) with each case's group catalog as its
    prompt tools, grouped by group (cases of one group run back to back: their prefix is shared)."""
    if target < 1:
        raise CatalogError(f"--catalog-tokens must be positive, got {target}")
    if n_ctx_train is not None and target >= n_ctx_train:
        raise CatalogError(f"--catalog-tokens {target} is larger than the model's trained context ({n_ctx_train})")
    wanted = {c.id for c in selected}
    out: list[Case] = []
    for group in group_cases(split_cases, group_size):
        members = [c for c in group.cases if c.id in wanted]
        if not members:
            continue
        cat = build_catalog(group, split_cases, target, count, seed, tolerance)
        out += [replace(c, tools=cat.functions, meta=case_meta(c, cat)) for c in members]
    order = {c.id: i for i, c in enumerate(selected)}
    # categories keep their order in the selection; within one, a group's cases stay together
    first_of_cat: dict[str, int] = {}
    for c in selected:
        first_of_cat.setdefault(c.category, order[c.id])
    return sorted(out, key=lambda c: first_of_cat[c.category])
