"""Paired comparison of two runs on the same cases: wins, losses, same outputs, exact sign test.

Accuracy differences of a few points on a few hundred cases are within noise; a paired count is
sharper: on how many cases A is right and B wrong, and the reverse, with the exact two-sided sign
test (McNemar) p-value for "A and B are equally accurate" (ties dropped).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import PaskError


def parse_label(label: str) -> tuple[str, str]:
    """A run label as (method, budget key): 'pask@0.33' -> ('pask', '0.33'); 'full' -> ('full', 'full')."""
    if "@" not in label:
        return label, "full"
    method, budget = label.split("@", 1)
    try:
        return method, f"{float(budget):g}"
    except ValueError:
        raise PaskError(f"bad run label {label!r} (want METHOD@BUDGET, e.g. snapkv@0.2)") from None


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided binomial p-value for wins vs losses under p = 1/2 (ties dropped)."""
    if wins < 0 or losses < 0:
        raise ValueError("wins and losses must be >= 0")
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class Paired:
    """A vs B on ``n`` cases: A right and B wrong (``wins``), the reverse (``losses``), equal outputs."""

    n: int
    wins: int
    losses: int
    same_output: int

    @property
    def p(self) -> float:
        return sign_test(self.wins, self.losses)

    def as_dict(self) -> dict[str, Any]:
        return {"n": self.n, "wins": self.wins, "losses": self.losses, "p": round(self.p, 4),
                "same_output": self.same_output}


def pair(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> Paired:
    """Compare two lists of records of the same cases, in the same order (``valid``, ``output``)."""
    if len(a) != len(b):
        raise ValueError(f"paired runs need the same cases ({len(a)} vs {len(b)} records)")
    if any(x["id"] != y["id"] for x, y in zip(a, b, strict=True)):
        raise ValueError("paired records must be in the same case order")
    wins = sum(1 for x, y in zip(a, b, strict=True) if x["valid"] and not y["valid"])
    losses = sum(1 for x, y in zip(a, b, strict=True) if y["valid"] and not x["valid"])
    same = sum(1 for x, y in zip(a, b, strict=True) if x["output"] == y["output"])
    return Paired(len(a), wins, losses, same)
