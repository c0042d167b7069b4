"""``pask-local study table``: the method study's table from one or more ``pask-local eval`` output
directories.

Runs spread over several processes (one thread each, one ``--out`` each) are merged; only the cases
that every run holds are kept, so each row is measured on the same cases. Per budget: accuracy,
retention, agreement with Full KV, wall seconds, the best baseline, and every PASK variant paired
against it (wins/losses, exact sign test). Writes JSON, a markdown table and a plot.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..eval.paired import parse_label
from ..eval.study import build_study, load_dirs, markdown, plot


def study_table(dirs: Sequence[Path], runs: str | None = None, json_path: Path | None = None,
                md_path: Path | None = None, png_path: Path | None = None) -> str:
    """The merged table (markdown); also written to the paths given."""
    manifest, records = load_dirs(list(dirs))
    keep = [parse_label(s.strip()) for s in runs.split(",") if s.strip()] if runs else None
    study = build_study(records, keep)
    study["settings"] = manifest
    table = markdown(study)
    if json_path:
        json_path.write_text(json.dumps(study, indent=1) + "\n")
    if md_path:
        md_path.write_text(table)
    if png_path:
        plot(study, png_path)
    return table
