#!/usr/bin/env python3
"""Context sweep: TPOT, prefill time, K/V bytes and peak RSS of budgeted methods vs Full KV, per prompt length.

For each prompt length (``--contexts 2048,8192,16384,32768``: the bundled tools repeated with renamed
copies until the rendered prompt reaches that many tokens) it runs Full KV and every
``--methods`` x ``--budgets`` pair, each in its own subprocess (so peak RSS is that run's), one
request each with a call required, and prints the ratios to Full KV at the same length, measured in
this one sweep. Results: ``--json`` (rows + ratios) and ``--png`` (TPOT ratio, prefill ratio and
K/V bytes against prompt length).

  .venv/bin/python scripts/bench_context.py --model qwen2.5-coder-1.5b --contexts 2048,4096 \\
      --methods pask --budgets 0.33,0.2 --json out.json --png out.png

``--synthetic qwen3-4b`` writes (once, under ``--synthetic-dir``) a random-weight GGUF with
Qwen3-4B's shapes (36 layers, 32 query / 8 KV heads of 128, n_embd 2560, n_ff 9728; q4_0 matrices;
a small vocabulary) with the project's GGUF writer and sweeps it: its rows are labelled
``timing-only`` (random weights: speed and memory, never accuracy; the call it writes is whatever
the grammar forces).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # a fallback: an installed pask_local (editable or not) comes first
sys.path.insert(0, str(REPO / "scripts"))

QWEN3_4B_SHAPE = {"n_embd": 2560, "n_head": 32, "n_head_kv": 8, "head_dim": 128, "n_ff": 9728, "n_vocab": 1024,
                  "n_ctx": 40960}
REQUEST = "What is the weather like in Paris today? Please answer in celsius."


def synthetic_qwen3_4b(out_dir: Path, n_layer: int = 36) -> Path:
    from pask_local.calibration.synthetic import write_synthetic_gguf

    suffix = "" if n_layer == 36 else f"-{n_layer}layers"
    path = out_dir / f"synthetic-qwen3-4b-shaped{suffix}-q4_0.gguf"
    if not path.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        print(f"[sweep] writing {path.name} (timing-only, random weights) ...", file=sys.stderr, flush=True)
        tmp = path.with_suffix(".tmp")
        write_synthetic_gguf(tmp, arch="qwen3", n_layer=n_layer, dtype="q4_0", **QWEN3_4B_SHAPE)
        tmp.rename(path)
    return path


def add_model_options(ap: argparse.ArgumentParser) -> None:
    """--gguf / --model, or --synthetic qwen3-4b (timing-only) with its directory and layer count."""
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--synthetic", choices=["qwen3-4b"], default=None)
    ap.add_argument("--synthetic-dir", type=Path, default=Path.home() / ".cache" / "pask-local" / "synthetic")
    ap.add_argument("--synthetic-layers", type=int, default=36, help="fewer layers: a quicker timing-only model")


def bench_model(args: argparse.Namespace) -> Path:
    """The GGUF the options of ``add_model_options`` name (PaskError when it cannot be had)."""
    from pask_local.models import resolve_model

    if args.synthetic:
        return synthetic_qwen3_4b(args.synthetic_dir, args.synthetic_layers)
    return resolve_model(args.gguf, args.model)


def tools_for_length(model, n_tokens: int, notes: int = 0) -> tuple[int, int]:
    """The fewest repeated tools whose prompt has >= n_tokens tokens: (tools, prompt tokens).

    At most ``MAX_TOOLS`` tools (the request limit); past it a PaskError says to lengthen each tool
    (``--tool-notes``)."""
    from bench_engine import tool_set

    from pask_local.engine import Engine, EngineConfig, make_method
    from pask_local.errors import ContextLengthError, PaskError
    from pask_local.schema.tools import MAX_TOOLS, load_tools

    engine = Engine(model, make_method("full", model), EngineConfig(budget=1.0, max_tokens=32))

    def length(n: int) -> int:
        try:
            return engine.prepare([{"role": "user", "content": REQUEST}], load_tools(tool_set(n, notes)),
                                  "required").n_prompt
        except ContextLengthError:
            return sys.maxsize  # longer than the model takes: long enough for the search

    lo, hi = 1, 4
    while (n_hi := length(hi)) < n_tokens:
        if hi == MAX_TOOLS:
            raise PaskError(f"{MAX_TOOLS} tools (the request limit) with --tool-notes {notes} make a "
                            f"{n_hi}-token prompt, under {n_tokens}: raise --tool-notes")
        lo, hi = hi, min(hi * 2, MAX_TOOLS)
    while lo < hi:
        mid = (lo + hi) // 2
        if length(mid) >= n_tokens:
            hi = mid
        else:
            lo = mid + 1
    return hi, length(hi)


def run_one(spec: dict) -> dict:
    """One request in this process: the row for (gguf, tools, method, budget)."""
    from bench_engine import tool_set

    from pask_local.engine import Engine, EngineConfig, make_method
    from pask_local.llm import Model
    from pask_local.schema.tools import load_tools

    model = Model(spec["gguf"], n_gpu_layers=spec.get("ngl", 0))
    budget = spec["budget"]
    cfg = EngineConfig(budget=budget, max_tokens=spec["max_tokens"], n_ctx=spec["n_ctx"],
                       flash_attn=spec.get("flash_attn", False))
    engine = Engine(model, make_method(spec["method"], model), cfg)
    res = engine.run(load_tools(tool_set(spec["tools"], spec.get("tool_notes", 0))), REQUEST)
    s = res.stats
    return {"method": spec["method"], "budget": None if spec["method"] == "full" else budget,
            "n_prompt": s["n_prompt"], "n_gen": s["n_gen"], "prefill_ms": s["prefill_ms"],
            "tpot_ms": s["ms_per_token"], "step_ms": s["step_ms_per_token"], "kv_bytes": s["kv_bytes_allocated"],
            "kv_bytes_alignment": s["kv_bytes_alignment"], "held_over_full": s["budget_used_final"],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "valid": res.ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(ap)
    ap.add_argument("--contexts", default="2048,8192,16384,32768")
    ap.add_argument("--methods", default="pask")
    ap.add_argument("--budgets", default="0.33,0.2")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--ngl", type=int, default=0, help="layers on the GPU (a CUDA build; 99: all)")
    ap.add_argument("--flash-attn", action="store_true", help="flash attention in every run")
    ap.add_argument("--tool-notes", type=int, default=0,
                    help="words of usage notes added to each tool's description (prompts past what 256 tools make)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0

    from pask_local.errors import PaskError
    from pask_local.llm import Model

    if args.ngl < 0 or args.tool_notes < 0:
        print("error: --ngl and --tool-notes must be at least 0", file=sys.stderr)
        return 2
    try:
        lengths = [int(x) for x in args.contexts.split(",") if x.strip()]
        budgets = [float(x) for x in args.budgets.split(",") if x.strip()]
    except ValueError:
        print("error: --contexts takes integers and --budgets numbers, comma-separated", file=sys.stderr)
        return 2
    try:
        gguf = bench_model(args)
        model = Model(gguf, n_gpu_layers=0)  # tokenizes the prompts only
    except PaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    label = "timing-only (synthetic weights)" if args.synthetic else "real weights"
    rows: list[dict] = []
    for length in lengths:
        if length + args.max_tokens > model.n_ctx_train:
            print(f"[sweep] skip {length}: beyond the model's trained context {model.n_ctx_train}", file=sys.stderr)
            continue
        try:
            n_tools, n_prompt = tools_for_length(model, length, args.tool_notes)
        except PaskError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        jobs = [("full", 1.0)] + [(m, b) for m in args.methods.split(",") for b in budgets]
        for method, budget in jobs:
            print(f"[sweep] {length} tokens ({n_prompt} in {n_tools} tools): {method} {budget}", file=sys.stderr,
                  flush=True)
            spec = {"gguf": str(gguf), "tools": n_tools, "method": method, "budget": budget,
                    "max_tokens": args.max_tokens, "n_ctx": n_prompt + args.max_tokens + 1,
                    "ngl": args.ngl, "flash_attn": args.flash_attn, "tool_notes": args.tool_notes}
            proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True,
                                  text=True, env={**os.environ})
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                print(f"error: the {method} run at {length} tokens failed: {tail}", file=sys.stderr)
                return 1
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"context": length, "weights": label, **row})
    _ratios(rows)
    _table(rows, Path(gguf).name, label)
    if args.json:
        args.json.write_text(json.dumps({"model": Path(gguf).name, "weights": label, "ngl": args.ngl,
                                          "flash_attn": args.flash_attn, "tool_notes": args.tool_notes, "rows": rows}, indent=1))
    if args.png:
        _plot(rows, args.png, f"{Path(gguf).name} ({label})")
    return 0


def _ratios(rows: list[dict]) -> None:
    full = {r["context"]: r for r in rows if r["method"] == "full"}
    for r in rows:
        f = full[r["context"]]
        r["tpot_x_full"] = r["tpot_ms"] / f["tpot_ms"]
        r["prefill_x_full"] = r["prefill_ms"] / f["prefill_ms"]
        r["kv_x_full"] = r["kv_bytes"] / f["kv_bytes"]
        r["rss_x_full"] = r["peak_rss_bytes"] / f["peak_rss_bytes"]


def _table(rows: list[dict], name: str, label: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"context sweep: {name}, {label}")
    for col in ("context", "prompt", "method", "budget", "gen", "TPOT ms", "TPOT x full", "prefill x full",
                "K/V MiB", "K/V x full", "peak RSS MiB", "RSS x full", "step ms", "valid"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["context"]), str(r["n_prompt"]), r["method"], "-" if r["budget"] is None else str(r["budget"]),
                  str(r["n_gen"]), f"{r['tpot_ms']:.1f}", f"{r['tpot_x_full']:.2f}", f"{r['prefill_x_full']:.2f}",
                  f"{r['kv_bytes'] / 2**20:.1f}", f"{r['kv_x_full']:.2f}", f"{r['peak_rss_bytes'] / 2**20:.0f}",
                  f"{r['rss_x_full']:.2f}", f"{r['step_ms']:.2f}", str(r["valid"]))
    Console(width=200).print(t)


def _plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series: dict[str, list[dict]] = {}
    for r in rows:
        key = "full" if r["budget"] is None else f"{r['method']} @ {r['budget']}"
        series.setdefault(key, []).append(r)
    for key, rs in series.items():
        xs = [r["n_prompt"] for r in rs]
        axes[0].plot(xs, [r["tpot_x_full"] for r in rs], marker="o", label=key)
        axes[1].plot(xs, [r["prefill_x_full"] for r in rs], marker="o", label=key)
        axes[2].plot(xs, [r["kv_bytes"] / 2**20 for r in rs], marker="o", label=key)
    for ax, ylabel in zip(axes, ("TPOT / Full KV", "prefill time / Full KV", "K/V MiB allocated"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
