#!/usr/bin/env python
"""The method study's table from one or more ``pask-local eval`` output directories.

Runs spread over several processes (one thread each, one ``--out`` each) are merged; only the cases
that every run holds are kept, so each row is measured on the same cases. Per budget: accuracy,
retention, agreement with Full KV, wall seconds, the best baseline, and every PASK variant paired
against it (wins/losses, exact sign test). Writes JSON, a markdown table and a plot.

    .venv/bin/python scripts/eval_table.py results/table-a results/table-b \\
        --json docs/table.json --md docs/table.md --png docs/table.png [--runs full,snapkv@0.2,...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pask_local.errors import PaskError
from pask_local.eval.paired import parse_label
from pask_local.eval.study import build_study, load_dirs, markdown, plot


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="pask-local eval --out directories (same settings)")
    ap.add_argument("--runs", default=None, help="comma list of runs to keep (default: every run found)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        manifest, records = load_dirs(args.dirs)
        runs = [parse_label(s.strip()) for s in args.runs.split(",") if s.strip()] if args.runs else None
        study = build_study(records, runs)
    except PaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    study["settings"] = manifest
    table = markdown(study)
    print(table, end="")
    if args.json:
        args.json.write_text(json.dumps(study, indent=1) + "\n")
    if args.md:
        args.md.write_text(table)
    if args.png:
        plot(study, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
