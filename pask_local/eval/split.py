"""Deterministic calibration / evaluation split by hashing case ids.

A case is in the calibration split when the first 8 bytes of ``sha256("pask-split-v1:" + id)``, read
as an unsigned integer, fall below ``CALIB_FRACTION`` of 2**64. The split depends on nothing but the
id, so calibration never sees an evaluation case, whatever subset or order a run uses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Literal, TypeVar

from ..errors import PaskError

CALIB_FRACTION = 0.25
SPLITS = ("eval", "calib", "all")
_SALT = "pask-split-v1:"

Split = Literal["eval", "calib", "all"]
T = TypeVar("T")


def split_of(case_id: str, calib_fraction: float = CALIB_FRACTION) -> Literal["eval", "calib"]:
    digest = hashlib.sha256((_SALT + case_id).encode("utf-8")).digest()
    value = int.from_bytes(digest[:8], "big")
    return "calib" if value < int(calib_fraction * 2**64) else "eval"


def check_split(name: str) -> Split:
    if name not in SPLITS:
        raise PaskError(f"unknown split {name!r}; choose eval, calib or all")
    return name  # type: ignore[return-value]


def select(cases: Iterable[T], split: str, key=lambda c: c.id) -> list[T]:  # noqa: B008
    """The cases of ``split`` (order preserved); ``all`` keeps every case (e.g. a user's own dataset)."""
    wanted = check_split(split)
    if wanted == "all":
        return list(cases)
    return [c for c in cases if split_of(key(c)) == wanted]
