"""``pask-local study kv-bytes``: K/V bytes and accuracy of method studies against Full KV at f16
(``pask_local.eval.kvbytes``).

Each STUDY is a ``pask-local study run --out`` directory; the studies must differ in their K/V
element type only, one study per type (each is merged on its own). The model is the studies' GGUF
(checked by its size) unless ``--model``/``--gguf`` names it. The cases are those every run of every
study holds. Full KV's f16 bytes for a request are measured by creating the context with llama.cpp
(one per distinct size), not computed from the model's shape. Accuracy is the average over
categories on those cases; retention is against the Full KV f16 run. Writes ``OUT.json`` and
``OUT.md`` (the table is also returned for printing).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..eval.kvbytes import kv_bytes, markdown
from ..eval.study import StudyError, build_study, load_dirs
from .headroom import job_dirs


def check_studies(paths: Sequence[Path], manifests: Sequence[dict]) -> None:
    """The studies must differ in their K/V element type only (one study per type)."""
    from ..eval.runner import reference_settings

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


def study_kv_bytes(paths: Sequence[Path], out: Path, model: str | None = None, gguf: str | None = None) -> str:
    from ..engine.core import kv_type_id
    from ..kv_layered import kv_total_bytes
    from ..llm import Context, ContextConfig, Model
    from ..models import resolve_model

    studies = [load_dirs(job_dirs(p)) for p in paths]
    check_studies(paths, [m for m, _ in studies])
    first = studies[0][0]
    path = resolve_model(gguf, model) if gguf or model else Path(str(first.get("model")))
    if not path.is_file():
        raise StudyError(f"the studies' model {path} is not here: give --model or --gguf")
    if first.get("model_bytes") is not None and path.stat().st_size != first["model_bytes"]:
        raise StudyError(f"{path} is not the studies' model ({path.stat().st_size} bytes, "
                         f"the studies' {first['model_bytes']})")
    ids = sorted(set.intersection(*(set(build_study(recs)["case_ids"]) for _, recs in studies)))
    if not ids:
        raise StudyError("the studies have no case in common")
    wanted = set(ids)
    m = Model(path)
    sizes: dict[tuple[int, str], int] = {}

    def full_bytes(n_cells: int, kv_type: str) -> int:
        if (n_cells, kv_type) not in sizes:
            kv = kv_type_id(kv_type)
            ctx = Context(m, ContextConfig(n_ctx=n_cells, n_batch=512, type_k=kv, type_v=kv,
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
        m.close()
    acc = {k: (a, a / full_f16 if full_f16 else None) for k, a in accuracy.items()}
    for r in rows:
        r["accuracy"], r["retention_of_full_f16"] = acc.get((r["label"], r["kv_type"]), (None, None))
    table = (f"{len(ids)} cases, the same for every run; K/V bytes as shares of Full KV f16 for the same "
             "requests (summed over the cases)\n\n" + markdown(rows, acc))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"n_cases": len(ids), "case_ids": ids, "runs": rows},
                                                   indent=1) + "\n")
    out.with_suffix(".md").write_text(table)
    return table
