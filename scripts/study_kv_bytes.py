#!/usr/bin/env python
"""K/V bytes and accuracy of method studies against Full KV at f16 (``pask_local.eval.kvbytes``).

    .venv/bin/python scripts/study_kv_bytes.py docs/runs/qwen15-study docs/runs/qwen15-q8 \\
        --out docs/runs/qwen15-q8/kv_bytes

Each STUDY is a ``scripts/eval_study.py --out`` directory; the studies must differ in their K/V
element type only, one study per type (each is merged on its own). The model is the studies' GGUF
(checked by its size) unless ``--model``/``--gguf`` names it. The cases are those every
run of every study holds. Full KV's f16 bytes for a request are measured by creating the context
with llama.cpp (one per distinct size), not computed from the model's shape. Accuracy is the
average over categories on those cases; retention is against the Full KV f16 run. Writes
``OUT.json`` and ``OUT.md`` (also printed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pask_local.errors import PaskError
from pask_local.eval.kvbytes import kv_bytes, markdown
from pask_local.eval.store import RUN_FILE
from pask_local.eval.study import StudyError, build_study, load_dirs


def _study(path: Path) -> tuple[dict, dict]:
    dirs = sorted(d for d in path.iterdir() if (d / RUN_FILE).is_file()) if path.is_dir() else []
    if not dirs:
        raise StudyError(f"{path} holds no eval output directory (none with a {RUN_FILE})")
    return load_dirs(dirs)


def _check_studies(paths: list[Path], manifests: list[dict]) -> None:
    """The studies must differ in their K/V element type only (one study per type)."""
    from pask_local.eval.runner import reference_settings

    types = [m.get("kv_type") or "f16" for m in manifests]
    if len(set(types)) != len(types):
        raise StudyError(f"two studies have the same K/V type ({', '.join(types)}): give one study per type")
    base = {k: v for k, v in reference_settings(manifests[0]).items() if k != "kv_type"}
    for p, m in zip(paths[1:], manifests[1:], strict=True):
        diff = sorted(k for k, v in reference_settings(m).items() if k != "kv_type" and base.get(k) != v)
        if diff:
            raise StudyError(f"{p} was run with other settings than {paths[0]} ({', '.join(diff)})")
    if not isinstance(manifests[0].get("max_tokens"), int) or manifests[0]["max_tokens"] < 1:
        raise StudyError(f"{paths[0]} records no --max-tokens")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("studies", type=Path, nargs="+", help="scripts/eval_study.py --out directories")
    ap.add_argument("--model", default=None, help="a named model (default: the studies' own GGUF)")
    ap.add_argument("--gguf", default=None, help="a GGUF path (default: the studies' own GGUF)")
    ap.add_argument("--out", type=Path, required=True, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    try:
        from pask_local.engine.core import kv_type_id
        from pask_local.kv_layered import kv_total_bytes
        from pask_local.llm import Context, ContextConfig, Model
        from pask_local.models import resolve_model

        studies = [_study(p) for p in args.studies]
        _check_studies(args.studies, [m for m, _ in studies])
        first = studies[0][0]
        gguf = resolve_model(args.gguf, args.model) if args.gguf or args.model else Path(str(first.get("model")))
        if not gguf.is_file():
            raise StudyError(f"the studies' model {gguf} is not here: give --model or --gguf")
        if first.get("model_bytes") is not None and gguf.stat().st_size != first["model_bytes"]:
            raise StudyError(f"{gguf} is not the studies' model ({gguf.stat().st_size} bytes, "
                             f"the studies' {first['model_bytes']})")
        ids = sorted(set.intersection(*(set(build_study(recs)["case_ids"]) for _, recs in studies)))
        if not ids:
            raise StudyError("the studies have no case in common")
        wanted = set(ids)
        model = Model(gguf)
        sizes: dict[tuple[int, str], int] = {}

        def full_bytes(n_cells: int, kv_type: str) -> int:
            if (n_cells, kv_type) not in sizes:
                kv = kv_type_id(kv_type)
                ctx = Context(model, ContextConfig(n_ctx=n_cells, n_batch=512, type_k=kv, type_v=kv,
                                                   flash_attn=kv_type != "f16"))
                try:
                    sizes[(n_cells, kv_type)] = kv_total_bytes(ctx)
                finally:
                    ctx.close()
            return sizes[(n_cells, kv_type)]

        try:
            rows, accuracy, full_f16 = [], {}, None
            for manifest, recs in studies:
                kv_type = manifest.get("kv_type") or "f16"
                mine = {k: r for k, r in recs.items() if k[0] in wanted}
                rows += kv_bytes(mine, ids, kv_type, full_bytes, first["max_tokens"])
                for r in build_study(mine)["runs"]:
                    accuracy[(r["label"], kv_type)] = r["accuracy"]
                    if r["method"] == "full" and kv_type == "f16":
                        full_f16 = r["accuracy"]
        finally:
            model.close()
        acc = {k: (a, a / full_f16 if full_f16 else None) for k, a in accuracy.items()}
        for r in rows:
            r["accuracy"], r["retention_of_full_f16"] = acc.get((r["label"], r["kv_type"]), (None, None))
        table = (f"{len(ids)} cases, the same for every run; K/V bytes as shares of Full KV f16 for the same "
                 "requests (summed over the cases)\n\n" + markdown(rows, acc))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"n_cases": len(ids), "case_ids": ids, "runs": rows},
                                                            indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table)
    except (PaskError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
