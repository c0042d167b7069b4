#!/usr/bin/env python
"""Paired comparison of two runs in a ``pask-local eval`` output directory, on the cases both ran.

Accuracy differences of a few points on a few hundred cases are within noise; a paired count is
sharper: on how many cases A is right and B wrong, and the reverse, with the exact two-sided sign
test (McNemar) p-value for "A and B are equally accurate". Also: how often A's output is
character-for-character B's.

    .venv/bin/python scripts/eval_paired.py results/eval50 pask@0.33 snapkv@0.33 [full ...]
    .venv/bin/python scripts/eval_paired.py results/qwen-native full full --b-out results/qwen-plain

``--b-out DIR`` reads the runs compared with A from another output directory (e.g. the same
method under another ``--prompt-style``); the cases are still paired by id.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pask_local.eval.paired import parse_label, sign_test


def load(out: Path) -> dict[tuple[str, str, str], dict]:
    path = out / "cases.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found (give a pask-local eval --out directory)")
    recs = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        b = "full" if r["budget"] is None else f"{r['budget']:g}"
        recs[(r["id"], r["method"], b)] = r
    return recs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="pask-local eval output directory")
    ap.add_argument("a", help="run A, e.g. pask@0.33")
    ap.add_argument("others", nargs="+", help="runs to compare A with, e.g. snapkv@0.33 full")
    ap.add_argument("--b-out", type=Path, default=None, help="read the compared runs from this directory")
    args = ap.parse_args(argv)
    recs = load(args.out)
    recs_b = load(args.b_out) if args.b_out else recs
    tag_b = f"{args.b_out.name}:" if args.b_out else ""
    ma, ba = parse_label(args.a)
    ids_a = {i for (i, m, b) in recs if (m, b) == (ma, ba)}
    if not ids_a:
        print(f"error: no records for {args.a} in {args.out}", file=sys.stderr)
        return 1
    print("| A | B | cases | A acc % | B acc % | A right, B wrong | B right, A wrong | sign test p | same output % |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label in args.others:
        mb, bb = parse_label(label)
        ids = sorted(i for i in ids_a if (i, mb, bb) in recs_b)
        if not ids:
            print(f"error: no common cases of {args.a} and {label}", file=sys.stderr)
            return 1
        ra = [recs[(i, ma, ba)] for i in ids]
        rb = [recs_b[(i, mb, bb)] for i in ids]
        wins = sum(1 for x, y in zip(ra, rb, strict=True) if x["valid"] and not y["valid"])
        losses = sum(1 for x, y in zip(ra, rb, strict=True) if y["valid"] and not x["valid"])
        same = sum(1 for x, y in zip(ra, rb, strict=True) if x["output"] == y["output"])
        n = len(ids)
        print(f"| {args.a} | {tag_b}{label} | {n} | {100 * sum(x['valid'] for x in ra) / n:.1f} | "
              f"{100 * sum(y['valid'] for y in rb) / n:.1f} | {wins} | {losses} | {sign_test(wins, losses):.3f} | "
              f"{100 * same / n:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
