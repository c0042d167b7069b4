#!/usr/bin/env python
"""Split a method study's cases by whether Full KV's answer fits each budget (``pask_local.eval.headroom``).

    .venv/bin/python scripts/study_headroom.py --model qwen2.5-coder-1.5b docs/runs/qwen15-study

Reads the study's job directories (every subdirectory with a ``run.json``), keeps the cases every run
holds, tokenizes Full KV's outputs with the model, and writes ``STUDY/headroom.json`` and
``STUDY/headroom.md`` (also printed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pask_local.errors import PaskError
from pask_local.eval.headroom import answer_lengths, headroom, markdown
from pask_local.eval.store import RUN_FILE
from pask_local.eval.study import build_study, load_dirs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path, help="a scripts/eval_study.py --out directory")
    ap.add_argument("--model", default=None, help="a named model (pask-local models)")
    ap.add_argument("--gguf", default=None, help="a GGUF path (the study's model)")
    args = ap.parse_args(argv)
    try:
        from pask_local.llm import Model
        from pask_local.models import resolve_model

        dirs = sorted(d for d in args.study.iterdir() if (d / RUN_FILE).is_file()) if args.study.is_dir() else []
        if not dirs:
            raise PaskError(f"{args.study} holds no eval output directory (none with a {RUN_FILE})")
        _, records = load_dirs(dirs)
        ids = build_study(records)["case_ids"]
        model = Model(resolve_model(args.gguf, args.model))
        try:
            lengths = answer_lengths(records, ids, lambda text: model.tokenize(text, parse_special=True))
        finally:
            model.close()
        h = headroom(records, lengths, [i for i in ids if i not in lengths])
    except (PaskError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = markdown(h)
    (args.study / "headroom.json").write_text(json.dumps(h, indent=1) + "\n")
    (args.study / "headroom.md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
