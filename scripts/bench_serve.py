#!/usr/bin/env python3
"""Serving benchmark: Full KV vs budgeted methods at equal K/V memory, on loopback with the openai client.

For each ``--methods`` entry it starts ``pask-local serve`` (batched: one persistent context whose
slots are sized from ``--kv-mem``, the same MiB for every method, so a budget of 0.33 gets about 3x
the slots of Full KV), then replays BFCL live_multiple requests (their own long tool lists, prompts
of ``--min-prompt``..``--max-prompt`` tokens; the same requests, in the same order, for every
method) at each ``--concurrency`` level: ``--requests`` streamed chat completions with a call
required, that many in flight at once. Per level: requests/s, generated tokens/s, TTFT and TPOT
p50/p99 (from the stream's chunk times), the share of replies that are schema-valid calls; per
method: the pool's K/V bytes and slots, the server's peak RSS (VmHWM), and the host's share of a
step (sampling, grammar, tagging, eviction between decodes). Ratios are to Full KV at the same
concurrency, from this one run. Results: ``--json`` and ``--png``.

  .venv/bin/python scripts/bench_serve.py --model qwen2.5-coder-1.5b --kv-mem 0 --full-slots 2 \\
      --methods full,pask-prior,streaming --concurrency 1,2,6 --requests 6 --json out.json --png out.png

``--kv-mem 0`` (default) sizes the memory as ``--full-slots`` Full KV slots of ``--slot-len`` tokens.
``--synthetic qwen3-4b`` serves the project's random-weight Qwen3-4B-shaped GGUF: timing only (its
calls are whatever the grammar forces; its validity column means nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_context import add_model_options, bench_model  # noqa: E402
from loopback import free_port, proc_memory  # noqa: E402


def pick_requests(model_path: Path, n: int, lo: int, hi: int) -> list[dict]:
    """The first ``n`` live_multiple cases (bundled order) whose prompt has lo..hi tokens."""
    from pask_local.engine import Engine, EngineConfig, make_method
    from pask_local.eval.data import load_bundled
    from pask_local.llm import Model

    model = Model(model_path)
    engine = Engine(model, make_method("full", model), EngineConfig(budget=1.0, max_tokens=8))
    out = []
    for case in load_bundled("live_multiple"):
        tools = [{"type": "function", "function": f} for f in case.functions]
        msgs = [m for m in case.messages if m.get("role") in ("system", "user")]
        try:
            n_prompt = engine.prepare(msgs, case.functions, "required").n_prompt
        except Exception:  # a case the protocol cannot render: not a serving request
            continue
        if lo <= n_prompt <= hi:
            out.append({"id": case.id, "messages": msgs, "tools": tools, "n_prompt": n_prompt})
        if len(out) == n:
            break
    model.close()
    if len(out) < n:
        raise SystemExit(f"error: only {len(out)} live_multiple cases have {lo}..{hi}-token prompts")
    return out


def full_slot_bytes(model_path: Path, slot_len: int) -> int:
    from pask_local.engine import make_method
    from pask_local.engine.pool import SlotPool
    from pask_local.llm import Model

    model = Model(model_path)
    lay = SlotPool.layout_for(model, make_method("full", model), 1.0, slot_len, slots=1)
    one = SlotPool._measure(model, True, lay.capacities, slot_len)
    model.close()
    return one


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


class Served:
    """``pask-local serve`` in a subprocess, stopped with SIGINT."""

    def __init__(self, gguf: Path, method: str, budget: float, kv_mem_mib: int, slot_len: int, max_tokens: int,
                 threads: int, prefill_tokens: int, prefix_cache: bool) -> None:
        self.port = free_port()
        env = {**os.environ, "PASK_THREADS": str(threads), "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "pask_local.cli", "serve", "--gguf", str(gguf), "--method", method,
               "--budget", str(budget), "--kv-mem", str(kv_mem_mib), "--max-context", str(slot_len),
               "--max-tokens", str(max_tokens), "--prefill-tokens", str(prefill_tokens),
               "--prefix-cache" if prefix_cache else "--no-prefix-cache", "--queue", "1000", "--port", str(self.port),
               "--log-level", "warning", "--model-id", "bench"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"error: serve --method {method} exited: {self.proc.stderr.read().strip()}")
            try:
                self.health = _get(self.url + "/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(f"error: serve --method {method} did not come up in 300 s") from None
                time.sleep(0.3)

    def stop(self) -> int:
        peak = proc_memory(self.proc.pid, "VmHWM") if self.proc.poll() is None else 0
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return peak


def one_request(client, req: dict, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    n_gen = 0
    calls: dict[int, dict] = {}
    stream = client.chat.completions.create(model="bench", messages=req["messages"], tools=req["tools"],
                                            tool_choice="required", max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True})
    for ch in stream:
        if ch.usage is not None:
            n_gen = ch.usage.completion_tokens
        for choice in ch.choices:
            d = choice.delta
            if first is None and (d.content or d.tool_calls):
                first = time.perf_counter()
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
                c["arguments"] += tc.function.arguments or ""
    t1 = time.perf_counter()
    names = {t["function"]["name"] for t in req["tools"]}
    valid = bool(calls)
    for c in calls.values():
        try:
            valid = valid and c["name"] in names and isinstance(json.loads(c["arguments"]), dict)
        except json.JSONDecodeError:
            valid = False
    first = first or t1
    return {"ttft": first - t0, "tpot": (t1 - first) / (n_gen - 1) if n_gen > 1 else None, "n_gen": n_gen,
            "valid": valid, "latency": t1 - t0}


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_level(url: str, reqs: list[dict], concurrency: int, n: int, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    todo = [reqs[i % len(reqs)] for i in range(n)]
    lock = threading.Lock()
    done = [0]

    def work(r: dict) -> dict:
        out = one_request(client, r, max_tokens)
        with lock:
            done[0] += 1
            print(f"\r[bench]   {done[0]}/{n} requests", end="", file=sys.stderr, flush=True)
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        rows = list(ex.map(work, todo))
    wall = time.perf_counter() - t0
    print(file=sys.stderr)
    gen = sum(r["n_gen"] for r in rows)
    return {"concurrency": concurrency, "requests": n, "wall_s": wall, "requests_per_s": n / wall,
            "gen_tokens_per_s": gen / wall, "ttft_p50": pct([r["ttft"] for r in rows], 0.5),
            "ttft_p99": pct([r["ttft"] for r in rows], 0.99), "tpot_p50": pct([r["tpot"] for r in rows], 0.5),
            "tpot_p99": pct([r["tpot"] for r in rows], 0.99),
            "valid_share": statistics.mean(1.0 if r["valid"] else 0.0 for r in rows)}


def ratios(results: list[dict]) -> list[dict]:
    """Each run against Full KV with the same prefix-cache setting."""
    out = []
    for r in results:
        full = next((f for f in results if f["method"] == "full" and f["prefix_cache"] == r["prefix_cache"]), None)
        if full is None or r is full:
            continue
        for lv, fl in zip(r["levels"], full["levels"], strict=True):
            def q(key: str, lv=lv, fl=fl) -> float | None:
                return lv[key] / fl[key] if lv[key] and fl[key] else None
            out.append({"method": r["method"], "prefix_cache": r["prefix_cache"], "concurrency": lv["concurrency"],
                        "throughput": q("gen_tokens_per_s"),
                        "requests_per_s": q("requests_per_s"), "tpot_p50": q("tpot_p50"), "ttft_p50": q("ttft_p50"),
                        "peak_rss": r["peak_rss_bytes"] / full["peak_rss_bytes"] if full["peak_rss_bytes"] else None,
                        "kv_bytes": r["kv_bytes"] / full["kv_bytes"], "slots": r["slots"] / full["slots"]})
    return out


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for r in results:
        c = [lv["concurrency"] for lv in r["levels"]]
        label = f"{r['method']} ({r['slots']} slots, cache {'on' if r['prefix_cache'] else 'off'})"
        axes[0].plot(c, [lv["gen_tokens_per_s"] for lv in r["levels"]], marker="o", label=label)
        axes[1].plot(c, [(lv["tpot_p50"] or 0) * 1e3 for lv in r["levels"]], marker="o", label=label)
        axes[2].plot(c, [lv["ttft_p50"] for lv in r["levels"]], marker="o", label=label)
    for ax, t in zip(axes, ["generated tokens/s", "TPOT p50 (ms)", "TTFT p50 (s)"], strict=True):
        ax.set_xlabel("concurrent requests")
        ax.set_title(t)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(ap)
    ap.add_argument("--methods", default="full,pask-prior,streaming")
    ap.add_argument("--budget", type=float, default=0.33)
    ap.add_argument("--kv-mem", type=int, default=0, help="MiB of K/V for every method (0: --full-slots Full slots)")
    ap.add_argument("--full-slots", type=int, default=2)
    ap.add_argument("--slot-len", type=int, default=4096)
    ap.add_argument("--concurrency", default="1,2,6")
    ap.add_argument("--requests", type=int, default=6, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--min-prompt", type=int, default=1000)
    ap.add_argument("--max-prompt", type=int, default=3000)
    ap.add_argument("--prefill-tokens", type=int, default=128, help="serve --prefill-tokens")
    ap.add_argument("--prefix-cache", default="off,on", help="serve --prefix-cache settings to run: off, on or both")
    ap.add_argument("--threads", type=int, default=0, help="PASK_THREADS of the server (0: all cores)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from pask_local.errors import PaskError

    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        print("error: --concurrency takes integers, comma-separated", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    caches = [c.strip() == "on" for c in args.prefix_cache.split(",") if c.strip() in ("on", "off")]
    if not caches:
        print("error: --prefix-cache takes on, off or off,on", file=sys.stderr)
        return 2
    try:
        gguf = bench_model(args)
    except PaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kv_mem = args.kv_mem or -(-args.full_slots * full_slot_bytes(gguf, args.slot_len) // (1 << 20))
    reqs = pick_requests(gguf, max(levels + [args.requests]), args.min_prompt, args.max_prompt)
    print(f"[bench] {gguf.name}: {len(reqs)} requests of {min(r['n_prompt'] for r in reqs)}.."
          f"{max(r['n_prompt'] for r in reqs)} prompt tokens, K/V memory {kv_mem} MiB for every method",
          file=sys.stderr, flush=True)
    results = []
    for cache, method in [(c, m) for c in caches for m in methods]:
        srv = Served(gguf, method, args.budget, kv_mem, args.slot_len, args.max_tokens, args.threads or os.cpu_count(),
                     args.prefill_tokens, cache)
        try:
            pool = srv.health["pool"]
            print(f"[bench] {method}, prefix cache {'on' if cache else 'off'}: {pool['slots']} slot(s), "
                  f"K/V {pool['kv_bytes'] / (1 << 20):.1f} MiB", file=sys.stderr, flush=True)
            run_level(srv.url, reqs[:1], 1, 1, 8)  # warm-up
            lv = []
            for c in levels:
                print(f"[bench]  concurrency {c}", file=sys.stderr, flush=True)
                lv.append(run_level(srv.url, reqs, c, args.requests, args.max_tokens))
            pool = _get(srv.url + "/health")["pool"]
        finally:
            peak = srv.stop()
        results.append({"method": method, "prefix_cache": cache, "budget": None if method == "full" else args.budget,
                        "slots": pool["slots"], "kv_bytes": pool["kv_bytes"], "slot_bytes": pool["slot_bytes"],
                        "peak_rss_bytes": peak, "host_share": pool["host_share"],
                        "tokens_per_step": pool["tokens_per_step"],
                        "reused_prompt_tokens": pool["reused_prompt_tokens"],
                        "shared_prompt_tokens": pool.get("shared_prompt_tokens", 0), "levels": lv})
    rat = ratios(results)
    label = "timing-only (synthetic weights)" if args.synthetic else "real weights"
    out = {"model": gguf.name, "weights": label, "kv_mem_mib": kv_mem, "slot_len": args.slot_len,
           "max_tokens": args.max_tokens, "prefill_tokens": args.prefill_tokens, "requests": [r["id"] for r in reqs], "threads": args.threads or os.cpu_count(),
           "results": results, "ratios_to_full": rat}
    con = Console(width=max(150, Console().width))
    t = Table(title=f"{gguf.name} ({label}), K/V {kv_mem} MiB per method")
    for col in ["method", "cache", "slots", "K/V MiB", "conc", "req/s", "gen tok/s", "TTFT p50 s", "TPOT p50 ms",
                "TPOT p99 ms", "valid", "host share"]:
        t.add_column(col)
    for r in results:
        for lv in r["levels"]:
            t.add_row(r["method"], "on" if r["prefix_cache"] else "off", str(r["slots"]), f"{r['kv_bytes'] / (1 << 20):.0f}", str(lv["concurrency"]),
                      f"{lv['requests_per_s']:.3f}", f"{lv['gen_tokens_per_s']:.2f}", f"{lv['ttft_p50']:.1f}",
                      f"{(lv['tpot_p50'] or 0) * 1e3:.0f}", f"{(lv['tpot_p99'] or 0) * 1e3:.0f}",
                      f"{lv['valid_share']:.2f}", f"{r['host_share']:.3f}")
    con.print(t)
    if rat:
        t2 = Table(title="ratios to Full KV (same run, same concurrency)")
        for col in ["method", "cache", "conc", "throughput", "TPOT p50", "TTFT p50", "peak RSS", "K/V bytes", "slots"]:
            t2.add_column(col)
        for r in rat:
            t2.add_row(r["method"], "on" if r["prefix_cache"] else "off", str(r["concurrency"]),
                       *[f"{r[k]:.2f}" if r[k] is not None else "-" for k in
                         ("throughput", "tpot_p50", "ttft_p50", "peak_rss", "kv_bytes", "slots")])
        con.print(t2)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if args.png:
        plot(results, args.png, f"{gguf.name} ({label}), K/V {kv_mem} MiB per method")
    return 0


if __name__ == "__main__":
    sys.exit(main())
