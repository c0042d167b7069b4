"""``pask-local study compare``: paired comparison of two runs in a ``pask-local eval`` output
directory, on the cases both ran.

Accuracy differences of a few points on a few hundred cases are within noise; a paired count is
sharper: on how many cases A is right and B wrong, and the reverse, with the exact two-sided sign
test (McNemar) p-value for "A and B are equally accurate". Also: how often A's output is
character-for-character B's. ``b_out`` reads the runs compared with A from another output directory
(e.g. the same method under another ``--prompt-style``); the cases are still paired by id.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import PaskError
from ..eval.paired import parse_label, sign_test

HEADER = ("| A | B | cases | A acc % | B acc % | A right, B wrong | B right, A wrong | sign test p | same output % |\n"
          "|---|---|---|---|---|---|---|---|---|")


def load(out: Path) -> dict[tuple[str, str, str], dict]:
    """The records of ``out/cases.jsonl`` by (case id, method, budget key); a cut line is skipped."""
    path = out / "cases.jsonl"
    if not path.is_file():
        raise PaskError(f"{path} not found (give a pask-local eval --out directory)")
    recs = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        b = "full" if r["budget"] is None else f"{r['budget']:g}"
        recs[(r["id"], r["method"], b)] = r
    return recs


def compare(out: Path, a: str, others: Sequence[str], b_out: Path | None = None,
            emit: Callable[[str], None] = print) -> None:
    """Emit the table's header and one row per run in ``others`` (as each is computed)."""
    recs = load(out)
    recs_b = load(b_out) if b_out else recs
    tag_b = f"{b_out.name}:" if b_out else ""
    ma, ba = parse_label(a)
    ids_a = {i for (i, m, b) in recs if (m, b) == (ma, ba)}
    if not ids_a:
        raise PaskError(f"no records for {a} in {out}")
    emit(HEADER)
    for label in others:
        mb, bb = parse_label(label)
        ids = sorted(i for i in ids_a if (i, mb, bb) in recs_b)
        if not ids:
            raise PaskError(f"no common cases of {a} and {label}")
        ra = [recs[(i, ma, ba)] for i in ids]
        rb = [recs_b[(i, mb, bb)] for i in ids]
        wins = sum(1 for x, y in zip(ra, rb, strict=True) if x["valid"] and not y["valid"])
        losses = sum(1 for x, y in zip(ra, rb, strict=True) if y["valid"] and not x["valid"])
        same = sum(1 for x, y in zip(ra, rb, strict=True) if x["output"] == y["output"])
        n = len(ids)
        emit(f"| {a} | {tag_b}{label} | {n} | {100 * sum(x['valid'] for x in ra) / n:.1f} | "
             f"{100 * sum(y['valid'] for y in rb) / n:.1f} | {wins} | {losses} | {sign_test(wins, losses):.3f} | "
             f"{100 * same / n:.1f} |")
