#!/usr/bin/env python3
"""End-to-end engine benchmark: every method on the same request, in one run, as ratios to Full KV.

Prints, per method: prompt tokens, generated tokens, prefill ms, decode ms/token (TPOT), KV bytes
allocated, KV entries held at the end (fraction of full), and whether the call validated. Ratios
are against Full KV measured in the same process (machines are noisy: compare ratios, not ms).

  .venv/bin/python scripts/bench_engine.py [--budget 0.33] [--tools N] [--repeat 2] [--json out.json]

``--tools N`` repeats the bundled example tools with renamed copies to lengthen the prompt
(KV savings grow with context length). ``--step native,python`` runs each budgeted method with the
native persistence step and with the Python reference rules (rows ``method (python)``);
``--hysteresis F`` lets an over-target layer evict F x its prompt capacity more at once (0: exactly
to target every token). ``step ms`` is the time per
generated token spent in the persistence step (scores, selection, eviction, held counts), measured
inside the engine; ``step %`` is its share of that method's TPOT.
``--stats graph,callback`` runs each score method (H2O, TOVA, SnapKV, PyramidKV, pask-attn, pask-hybrid)
with its attention statistics computed in the decode graph (patch 0007, the default) and read by the
eval-callback probe (the reference: a host copy of every softmax; rows ``method (callback)``);
``--flash-attn off,on`` runs every method without and with flash attention (rows ``method (fa)``;
callback rows always run without it). Ratios are to Full KV with the same flash-attention setting.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # a fallback: an installed pask_local (editable or not) comes first

from pask_local.engine import Engine, EngineConfig, make_method  # noqa: E402
from pask_local.errors import PaskError  # noqa: E402
from pask_local.llm import Model  # noqa: E402
from pask_local.methods import METHOD_NAMES  # noqa: E402
from pask_local.models import resolve_model  # noqa: E402
from pask_local.schema.tools import load_tools  # noqa: E402

NOTE_SENTENCE = ("Call this tool only when the request names what it does, pass every required argument "
                 "with the type its schema gives, and leave optional arguments out unless the user asks. ")


def tool_set(n: int, notes: int = 0) -> list[dict]:
    """``n`` tools: the bundled examples, then renamed copies; ``notes`` > 0 appends that many words of
    usage notes to each description (longer prompts from fewer tools)."""
    base = []
    for name in ("get_weather.json", "calendar.json", "bfcl_math.json", "parallel_shopping.json"):
        data = json.loads((REPO / "examples" / name).read_text())
        if isinstance(data, dict) and isinstance(data.get("tools"), list):
            data = data["tools"]
        base += data if isinstance(data, list) else [data]
    out = []
    for i in range(n):
        t = copy.deepcopy(base[i % len(base)])
        fn = t.get("function", t)
        if i >= len(base):
            fn["name"] = f"{fn['name']}_{i // len(base)}"
        if notes > 0:
            words = itertools.islice(itertools.cycle(NOTE_SENTENCE.split()), notes)
            fn["description"] = (fn.get("description", "") + " " + " ".join(words)).strip()
        out.append(t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="a GGUF path (or hf://...)")
    ap.add_argument("--model", default=None, help="a named model (pask-local models)")
    ap.add_argument("--budget", type=float, default=0.33)
    ap.add_argument("--tools", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHOD_NAMES))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--step", default="native", help="comma list of native | python (the reference rules)")
    ap.add_argument("--hysteresis", type=float, default=EngineConfig.hysteresis)
    ap.add_argument("--stats", default="graph", help="comma list of graph | callback (score methods)")
    ap.add_argument("--flash-attn", default="off", help="comma list of off | on")
    args = ap.parse_args()

    try:
        model = Model(resolve_model(args.gguf, args.model))
    except PaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    steps = [x.strip() for x in args.step.split(",") if x.strip()]
    if any(x not in ("native", "python") for x in steps):
        ap.error("--step takes native and/or python")
    stats_modes = [x.strip() for x in args.stats.split(",") if x.strip()]
    fa_modes = [x.strip() for x in args.flash_attn.split(",") if x.strip()]
    if any(x not in ("graph", "callback") for x in stats_modes) or any(x not in ("off", "on") for x in fa_modes):
        ap.error("--stats takes graph and/or callback, --flash-attn off and/or on")
    tools = load_tools(tool_set(args.tools))
    request = "What is the weather like in Paris today? Please answer in celsius."
    rows = {}
    # one untimed run first: page the weights in and warm the caches (else the first method pays for it)
    Engine(model, make_method("full", model), EngineConfig(budget=1.0, max_tokens=8)).run(tools, request)
    jobs = []
    for name in args.methods.split(","):
        scores = make_method(name, model).needs_attention and name != "full"
        for step in (steps if name != "full" else ["native"]):
            for stats in (stats_modes if scores else ["graph"]):
                for fa in (fa_modes if stats == "graph" else ["off"]):
                    jobs.append((name, step, stats, fa))
    for name, step, stats, fa in jobs:
        budget = 1.0 if name == "full" else args.budget
        cfg = EngineConfig(budget=budget, max_tokens=args.max_tokens, native_step=step == "native",
                           hysteresis=args.hysteresis, graph_stats=stats == "graph", flash_attn=fa == "on")
        engine = Engine(model, make_method(name, model), cfg)
        runs = [engine.run(tools, request) for _ in range(args.repeat)]
        s = runs[-1].stats
        key = name + ("" if step == "native" else " (python)") + (" (callback)" if stats == "callback" else "") + \
            (" (fa)" if fa == "on" else "")
        rows[key] = {
            "flash_attn": fa == "on", "stats": stats if name != "full" else None,
            "n_prompt": s["n_prompt"], "n_gen": s["n_gen"],
            "prefill_ms": statistics.median(r.stats["prefill_ms"] for r in runs),
            "tpot_ms": statistics.median(r.stats["ms_per_token"] for r in runs),
            "kv_bytes": s["kv_bytes_allocated"], "kv_used": s["budget_used_final"],
            "peak_prefill_entries": s["peak_prefill_entries"], "valid": all(r.ok for r in runs),
            "step_ms": statistics.median(r.stats["step_ms_per_token"] for r in runs),
        }
    fulls = {False: rows.get("full"), True: rows.get("full (fa)")}
    table = Table(title=f"engine benchmark: {model.path.name}, {args.tools} tools, budget {args.budget}, "
                        f"hysteresis {args.hysteresis}")
    for col in ("method", "prompt", "gen", "prefill ms", "prefill x full", "TPOT ms", "TPOT x full", "step ms", "step %", "KV MiB",
                "KV x full", "held/full", "valid"):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        full = fulls[r["flash_attn"]]
        tpot_x = f"{r['tpot_ms'] / full['tpot_ms']:.2f}" if full else "-"
        kv_x = f"{r['kv_bytes'] / full['kv_bytes']:.2f}" if full else "-"
        pre_x = f"{r['prefill_ms'] / full['prefill_ms']:.2f}" if full else "-"
        table.add_row(name, str(r["n_prompt"]), str(r["n_gen"]), f"{r['prefill_ms']:.0f}", pre_x, f"{r['tpot_ms']:.1f}",
                      tpot_x, f"{r['step_ms']:.2f}", f"{100 * r['step_ms'] / r['tpot_ms']:.1f}",
                      f"{r['kv_bytes'] / 2**20:.2f}", kv_x, f"{r['kv_used']:.3f}", str(r["valid"]))
    Console(width=200).print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
