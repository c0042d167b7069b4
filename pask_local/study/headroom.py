"""``pask-local study headroom``: split a method study's cases by whether Full KV's answer fits each
budget (``pask_local.eval.headroom``).

Reads the study's job directories (every subdirectory with a ``run.json``), keeps the cases every run
holds, tokenizes Full KV's outputs with the model, and writes ``STUDY/headroom.json`` and
``STUDY/headroom.md`` (the table is also returned for printing).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..eval.headroom import answer_lengths, headroom, markdown
from ..eval.store import RUN_FILE
from ..eval.study import StudyError, build_study, load_dirs


def job_dirs(study: Path) -> list[Path]:
    """The eval output directories of a ``pask-local study run --out`` directory (those with a run.json)."""
    dirs = sorted(d for d in study.iterdir() if (d / RUN_FILE).is_file()) if study.is_dir() else []
    if not dirs:
        raise StudyError(f"{study} holds no eval output directory (none with a {RUN_FILE})")
    return dirs


def study_headroom(study: Path, model: str | None = None, gguf: str | None = None) -> str:
    from ..llm import Model
    from ..models import resolve_model

    _, records = load_dirs(job_dirs(study))
    ids = build_study(records)["case_ids"]
    m = Model(resolve_model(gguf, model))
    try:
        lengths = answer_lengths(records, ids, lambda text: m.tokenize(text, parse_special=True))
    finally:
        m.close()
    h = headroom(records, lengths, [i for i in ids if i not in lengths])
    table = markdown(h)
    (study / "headroom.json").write_text(json.dumps(h, indent=1) + "\n")
    (study / "headroom.md").write_text(table)
    return table
