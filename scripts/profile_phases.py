#!/usr/bin/env python3
"""Where one request's CPU time goes, per phase (prefill, decode): perf samples by library and function.

Runs one request (the bundled tools repeated up to ``--context`` prompt tokens, as
``scripts/bench_context.py`` does) in a child process under ``perf record``, splits the samples at
the request's own phase boundaries (the child prints its CLOCK_MONOTONIC times; perf records with
the same clock) and reports, per phase, the share of samples in each library and the functions of
``libllama`` (the KV cache and its masks, the native step, the grammar) that hold the most. This is
how the per-layer host KQ mask of the layered cache was priced (docs/native-step.md).

  .venv/bin/python scripts/profile_phases.py --model qwen2.5-coder-1.5b --context 8192 \\
      --method pask --budget 0.33 --json out.json

Needs ``perf`` (linux-perf) with sampling allowed (``kernel.perf_event_paranoid`` <= 2). The
installed libraries are stripped; the unstripped copies ``scripts/build_llama.py`` leaves in its
build directories (same build id) are added to perf's build-id cache first, so hidden functions
(``set_input_kq_mask_impl``, the step's selection) are named. Without them a sample in a hidden
function shows as an address.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

# a perf report line with -n --sort dso,sym: "  12.34%   567  libggml-cpu.so.0  [.] ggml_vec_dot_f16"
_LINE = re.compile(r"^\s*([\d.]+)%\s+(\d+)\s+(\S+)\s+\[(.)\]\s+(.*?)\s*$")
EDGE = 0.03  # each phase window is shrunk by this fraction at both ends (the boundaries are approximate)


def record_argv(data: Path, freq: int) -> list[str]:
    """``perf record`` writing ``data`` at ``freq`` Hz, stamped with CLOCK_MONOTONIC (the child's phase clock)."""
    return ["perf", "record", "-q", "-F", str(freq), "-k", "CLOCK_MONOTONIC", "-o", str(data)]


def add_symbols() -> int:
    """Offer perf the unstripped libraries of the cached builds (it keeps those whose build id it sees)."""
    from pask_local.models import cache_dir

    n = 0
    for lib in sorted((cache_dir() / "build").glob("*/bin/lib*.so.*.*.*")):
        ok = subprocess.run(["perf", "buildid-cache", "-u", str(lib)], capture_output=True).returncode == 0
        n += ok
    return n


def child(spec: dict) -> dict:
    """The request itself: its row and the monotonic times that bound its phases."""
    from bench_context import run_one

    t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
    row = run_one(spec)
    t1 = time.clock_gettime(time.CLOCK_MONOTONIC)
    decode_s = row["n_gen"] * row["tpot_ms"] / 1000.0
    prefill_s = row["prefill_ms"] / 1000.0
    row["windows"] = {"prefill": [t1 - decode_s - prefill_s, t1 - decode_s], "decode": [t1 - decode_s, t1]}
    row["run_s"] = t1 - t0
    return row


def parse_report(text: str) -> list[dict]:
    """Rows of ``perf report -n --sort dso,sym --stdio``: samples, library, function."""
    rows = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            rows.append({"samples": int(m.group(2)), "dso": m.group(3), "sym": m.group(5)})
    return rows


def phase_shares(data: Path, window: list[float], top: int) -> dict:
    """Samples in [start, end] of the window (shrunk by EDGE): shares by library, top libllama functions."""
    a, b = window
    pad = (b - a) * EDGE
    proc = subprocess.run(["perf", "report", "-i", str(data), "--time", f"{a + pad:.6f},{b - pad:.6f}", "-n",
                           "--sort", "dso,sym", "--stdio", "--percent-limit", "0"],
                          capture_output=True, text=True, check=True)
    rows = parse_report(proc.stdout)
    total = sum(r["samples"] for r in rows)
    if total == 0:
        return {"samples": 0, "seconds": b - a, "by_library": {}, "libllama_top": []}
    by_lib: dict[str, int] = {}
    for r in rows:
        by_lib[r["dso"]] = by_lib.get(r["dso"], 0) + r["samples"]
    llama = sorted((r for r in rows if r["dso"].startswith("libllama")), key=lambda r: -r["samples"])[:top]
    return {"samples": total, "seconds": b - a,
            "by_library": {k: round(v / total, 5) for k, v in sorted(by_lib.items(), key=lambda kv: -kv[1])},
            "libllama_top": [{"function": r["sym"], "share": round(r["samples"] / total, 5)} for r in llama]}


def main() -> int:
    from bench_context import add_model_options, bench_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(ap)
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens (at least)")
    ap.add_argument("--method", default="pask")
    ap.add_argument("--budget", type=float, default=0.33)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--freq", type=int, default=999, help="perf samples per second")
    ap.add_argument("--top", type=int, default=8, help="libllama functions listed per phase")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(child(json.loads(args.one))))
        return 0

    from bench_context import tools_for_length

    from pask_local.errors import PaskError
    from pask_local.llm import Model

    if shutil.which("perf") is None:
        print("error: perf is not installed (Debian: linux-perf)", file=sys.stderr)
        return 2
    try:
        gguf = bench_model(args)
        model = Model(gguf, n_gpu_layers=0)  # tokenizes the prompt only
        n_tools, n_prompt = tools_for_length(model, args.context)
        model.close()
    except PaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n_sym = add_symbols()
    spec = {"gguf": str(gguf), "tools": n_tools, "method": args.method, "budget": args.budget,
            "max_tokens": args.max_tokens, "n_ctx": n_prompt + args.max_tokens + 1}
    print(f"[profile] {args.method} {args.budget} on {n_prompt} prompt tokens under perf ...", file=sys.stderr,
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        proc = subprocess.run([*record_argv(data, args.freq), sys.executable, __file__, "--one", json.dumps(spec)],
                              capture_output=True, text=True, env={**os.environ})
        if proc.returncode != 0 or not data.is_file():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"error: the profiled run failed: {tail}", file=sys.stderr)
            return 1
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        phases = {name: phase_shares(data, w, args.top) for name, w in row.pop("windows").items()}
    out = {"model": Path(gguf).name, "symbol_files": n_sym, "threads": os.environ.get("PASK_THREADS", "all"),
           "row": row, "phases": phases}
    for name, p in phases.items():
        print(f"\n{name}: {p['samples']} samples over {p['seconds']:.1f} s")
        print("| library | share |\n|---|---|")
        for lib, share in list(p["by_library"].items())[:6]:
            print(f"| {lib} | {100 * share:.2f}% |")
        print("| libllama function | share |\n|---|---|")
        for f in p["libllama_top"]:
            print(f"| {f['function'][:70]} | {100 * f['share']:.2f}% |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
