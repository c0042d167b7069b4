"""Benchmark: a restored prefix file vs a full prefill (TTFT, restore time, file size), one catalog.

The catalog is the first simple_python eval group's, filled to ``--catalog-tokens`` with BFCL
distractors (``eval.catalog``, seed 0). For each K/V type, Full KV and ``--method`` at each budget
are compressed once (``pask-local compress``'s path) and saved; then one question is answered
(tool_choice required, greedy, ``--max-tokens``) three ways, all in this process: a fresh request
(whole prompt prefilled, Full KV), and from each saved file (restored, only the question prefilled).
TTFT is the time to the first token (render, restore, prefill, first choice); restore is the state
copy alone. Prints a table of ratios to the fresh request and to Full KV's file, and writes JSON.

    PASK_THREADS=2 .venv/bin/python scripts/bench_prefix.py --model qwen2.5-coder-1.5b \\
        --catalog-tokens 8000 --out docs/runs/prefix-bench/qwen15-8k.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pask_local.engine import Engine, EngineConfig, make_method
from pask_local.engine.pool import SlotPool
from pask_local.eval.catalog import apply_catalogs
from pask_local.eval.data import load_bundled
from pask_local.eval.prompting import make_task, prefix_counter
from pask_local.eval.split import split_of
from pask_local.llm import Model
from pask_local.models import resolve_model
from pask_local.prefix import state as kv_state
from pask_local.prefix.build import compress, open_file, pin, run_from_prefix, save
from pask_local.schema.tools import as_tools


def catalog_case(model: Model, tokens: int, examples: bool = False) -> Any:
    """The first eval-split simple_python case behind a catalog of about ``tokens`` prefix tokens, as
    counted for a prompt with or without the in-prompt examples."""
    cases = [c for c in load_bundled("simple_python") if split_of(c.id) == "eval"]
    with_catalog = apply_catalogs(cases[:1], cases, tokens, prefix_counter(model, "native", examples),
                                  n_ctx_train=model.n_ctx_train)
    return with_catalog[0]


def first_token_hook(t0: float, box: dict[str, float]) -> Any:
    def hook(_tok: int) -> bool:
        box.setdefault("ttft", time.perf_counter() - t0)
        return False
    return hook


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--catalog-tokens", type=int, default=8000)
    ap.add_argument("--method", default="pask-prior")
    ap.add_argument("--budgets", default="0.33,0.2")
    ap.add_argument("--kv-types", default="f16,q8_0")
    ap.add_argument("--full-kv-types", default="f16", help="K/V types that also get a Full KV file")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model = Model(resolve_model(None, args.model))
    case = catalog_case(model, args.catalog_tokens)
    task = make_task(case, use_examples=False)
    tools = as_tools(task.functions)
    msgs = task.conversation()
    work = args.out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []

    def engine(method: str, budget: float, kv_type: str) -> Engine:
        return Engine(model, make_method(method, model), EngineConfig(
            budget=budget, max_tokens=args.max_tokens, style="native", kv_type=kv_type,
            flash_attn=kv_type != "f16"))

    for kv_type in args.kv_types.split(","):
        full = [("full", None)] if kv_type in args.full_kv_types.split(",") else []
        for method, budget in full + [(args.method, float(b)) for b in args.budgets.split(",")]:
            eng = engine(method, budget or 1.0, kv_type)
            t0 = time.perf_counter()
            c = compress(eng, tools, list(msgs[:-1]), parallel=task.parallel)
            compress_s = time.perf_counter() - t0
            path = work / f"{method}-{budget or 1}-{kv_type}.pkv"
            size = save(path, c)
            t0 = time.perf_counter()
            header, blob = open_file(path, model)
            pinned = pin(path, header, blob, model, method, budget, kv_type, tools)
            open_s = time.perf_counter() - t0
            prepared = eng.prepare(msgs, tools, "required", parallel=task.parallel)
            box = {}
            t0 = time.perf_counter()
            res = run_from_prefix(eng, prepared, pinned, on_token=first_token_hook(t0, box))
            total = time.perf_counter() - t0
            # the state copy alone, into a context of the run's kind
            pool = SlotPool(model, SlotPool.layout_for(model, eng.method, eng.cfg.budget, prepared.n_prompt + 64,
                                                       slots=1, kv_type=kv_type), flash_attn=kv_type != "f16")
            t1 = time.perf_counter()
            kv_state.restore(pool.ctx, 0, blob)
            restore_s = time.perf_counter() - t1
            pool.close()
            row = {"name": method if budget is None else f"{method}@{budget:g}", "kv_type": kv_type,
                   "prefix_tokens": header.n_prefix, "file_bytes": size, "held_entries": c.held,
                   "full_entries": c.full, "compress_s": compress_s, "open_s": open_s, "restore_s": restore_s,
                   "ttft_s": box.get("ttft", float("nan")), "total_s": total, "n_prompt": prepared.n_prompt,
                   "prefix_reused": res.stats.get("prefix_reused"), "call": res.parsed}
            rows.append(row)
            print(json.dumps(row), flush=True)
    # the fresh request (measured last, under the load the files saw): Full KV, the whole prompt
    # prefilled, in a one-slot pool as a server runs it
    eng = engine("full", 1.0, "f16")
    prepared = eng.prepare(msgs, tools, "required", parallel=task.parallel)
    box: dict[str, float] = {}
    pool = SlotPool(model, SlotPool.layout_for(model, eng.method, 1.0, prepared.n_prompt + args.max_tokens, slots=1))
    t0 = time.perf_counter()
    res = pool.submit(eng, prepared, first_token_hook(t0, box)).result()
    fresh = {"name": "fresh Full KV", "kv_type": "f16", "n_prompt": prepared.n_prompt, "ttft_s": box["ttft"],
             "total_s": time.perf_counter() - t0, "call": res.parsed}
    pool.close()
    print(json.dumps(fresh), flush=True)
    full_size = {r["kv_type"]: r["file_bytes"] for r in rows if r["name"] == "full"}
    f16_full = full_size.get("f16")
    for r in rows:
        r["ttft_vs_fresh"] = r["ttft_s"] / fresh["ttft_s"]
        r["file_vs_full_same_type"] = r["file_bytes"] / full_size[r["kv_type"]] if r["kv_type"] in full_size else None
        r["file_vs_full_f16"] = r["file_bytes"] / f16_full if f16_full else None
    result = {"model": args.model, "catalog_tokens": args.catalog_tokens, "case": case.id, "fresh": fresh,
              "files": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nfresh Full KV: {fresh['n_prompt']} prompt tokens, TTFT {fresh['ttft_s']:.2f} s\n")
    print("| prefix file | K/V | file MiB | vs Full f16 | compress s | restore s | TTFT s | TTFT vs fresh |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['kv_type']} | {r['file_bytes'] / 2**20:.1f} | {r['file_vs_full_f16']:.3f} | "
              f"{r['compress_s']:.1f} | {r['restore_s']:.3f} | {r['ttft_s']:.2f} | {r['ttft_vs_fresh']:.3f} |")


if __name__ == "__main__":
    main()
