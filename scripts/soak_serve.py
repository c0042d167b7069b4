#!/usr/bin/env python3
"""Soak test of ``pask-local serve``: many requests, a share of them bad, against one server process.

Starts ``pask-local serve`` (batched by default) on loopback and sends ``--requests`` requests,
``--concurrency`` at a time, cycling through a fixed mix: good calls (tool_choice required, auto
with a named tool, streamed and not, parallel), and bad ones (a body that is not JSON, an unknown
model, an invalid tool schema, an unknown method, a prompt longer than a slot, a stream the client
drops after a few chunks). Every good reply must be a call whose arguments validate against its
tool's schema; every bad one must get its 4xx (never a 5xx); the server must report no failed
request (``pask_requests_finished_total{reason="error"}`` stays 0) and its resident memory at the
end must be within ``--rss-tolerance`` of what it was after the warm-up (the first 10%). Bounded
by ``--max-seconds``. Prints a table, writes ``--json``; exit status 1 if any check failed.

  .venv/bin/python scripts/soak_serve.py --requests 1000 --concurrency 4 --json soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from loopback import free_port, proc_memory  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
CITIES = ["Oslo", "Paris", "Rome", "Lima", "Cairo", "Quito", "Seoul", "Hanoi", "Dakar", "Perth"]

# the cycle of request kinds (11 per cycle: 6 good, 5 bad, one dropped stream)
MIX = ["call", "bad_json", "call_stream", "unknown_model", "call_named", "bad_tools", "call_parallel",
       "drop_stream", "call", "too_long", "bad_method"]
EXPECT = {"bad_json": 400, "unknown_model": 404, "bad_tools": 400, "too_long": 400, "bad_method": 400}


def _post(url: str, body: bytes) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, flags=re.M)
    return float(m.group(1)) if m else 0.0


def valid_calls(calls: list[tuple[str, str]]) -> bool:
    import jsonschema

    if not calls:
        return False
    for name, arguments in calls:
        if name not in SCHEMAS:
            return False
        try:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
    return True


def one(kind: str, i: int, url: str, client, long_text: str, max_tokens: int) -> tuple[str, bool, str]:
    """(kind, passed, detail) for request ``i`` of ``kind``."""
    import openai

    city = CITIES[i % len(CITIES)]
    msgs = [{"role": "user", "content": f"What is the weather in {city} right now?"}]
    base = {"model": "soak", "messages": msgs, "tools": [WEATHER, TIME], "max_tokens": max_tokens}
    if kind in EXPECT:
        if kind == "bad_json":
            status, text = _post(url + "/v1/chat/completions", b'{"model": "soak", "messages": [')
        else:
            body = dict(base, tool_choice="required")
            if kind == "unknown_model":
                body["model"] = "gpt-9"
            elif kind == "bad_tools":
                body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]
            elif kind == "too_long":
                body["messages"] = [{"role": "user", "content": long_text}]
            elif kind == "bad_method":
                body["pask"] = {"method": "nope"}
            status, text = _post(url + "/v1/chat/completions", json.dumps(body).encode())
        ok = status == EXPECT[kind] and '"error"' in text
        return kind, ok, f"status {status}"
    try:
        if kind == "drop_stream":
            stream = client.chat.completions.create(**base, tool_choice="required", stream=True)
            for n, _ in enumerate(stream):
                if n == 2:
                    break
            stream.close()
            return kind, True, "dropped"
        if kind == "call_stream":
            calls: dict[int, list[str]] = {}
            for ch in client.chat.completions.create(**base, tool_choice="required", stream=True):
                for choice in ch.choices:
                    for tc in choice.delta.tool_calls or []:
                        c = calls.setdefault(tc.index, [tc.function.name or "", ""])
                        c[1] += tc.function.arguments or ""
            got = [(n, a) for n, a in calls.values()]
        else:
            kw = dict(base)
            if kind == "call_named":
                kw["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
                kw["parallel_tool_calls"] = False
            elif kind == "call_parallel":  # room for the longest list the server allows (8 calls)
                kw["messages"] = [{"role": "user", "content": f"Weather in {city} and the time in Tokyo?"}]
                kw["tool_choice"] = "required"
                kw["max_tokens"] = 4 * max_tokens
            else:
                kw["tool_choice"] = "required"
                kw["parallel_tool_calls"] = False
            r = client.chat.completions.create(**kw)
            got = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
        ok = valid_calls(got)
        return kind, ok, "" if ok else f"not a valid call: {got}"
    except openai.APIStatusError as exc:
        return kind, False, f"status {exc.status_code}: {exc.message}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--method", default="pask")
    ap.add_argument("--budget", type=float, default=0.33)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--no-batch", action="store_true")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--max-seconds", type=float, default=3600)
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import openai
    from rich.console import Console
    from rich.table import Table

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PASK_THREADS": str(args.threads or os.cpu_count()), "PYTHONPATH": str(REPO)}
    model_args = ["--gguf", args.gguf] if args.gguf else ["--model", args.model]
    cmd = [sys.executable, "-m", "pask_local.cli", "serve", *model_args, "--method", args.method, "--budget",
           str(args.budget), "--slots", str(args.slots), "--queue", str(4 * args.concurrency + 8),
           "--max-context", str(args.max_context), "--max-tokens", str(args.max_tokens), "--port", str(port),
           "--log-level", "error", "--model-id", "soak", *(["--no-batch"] if args.no_batch else [])]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            print(f"error: serve exited: {proc.stderr.read().strip()}", file=sys.stderr)
            return 2
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                print("error: serve did not come up in 300 s", file=sys.stderr)
                return 2
            time.sleep(0.3)

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    long_text = "weather " * (args.max_context + 64)
    results: list[tuple[str, bool, str]] = []
    lock = threading.Lock()
    warm = max(1, args.requests // 10)
    rss_warm = 0
    t0 = time.monotonic()
    stopped = False

    def work(i: int) -> tuple[str, bool, str] | None:
        nonlocal rss_warm
        if time.monotonic() - t0 > args.max_seconds:
            return None
        res = one(MIX[i % len(MIX)], i, url, client, long_text, args.max_tokens)
        with lock:
            results.append(res)
            if len(results) == warm:
                rss_warm = proc_memory(proc.pid)
            if len(results) % 25 == 0:
                print(f"\r[soak] {len(results)}/{args.requests} requests, {time.monotonic() - t0:.0f} s",
                      end="", file=sys.stderr, flush=True)
        return res

    try:
        with ThreadPoolExecutor(args.concurrency) as ex:
            done = list(ex.map(work, range(args.requests)))
        stopped = any(d is None for d in done)
        print(file=sys.stderr)
        deadline = time.monotonic() + 60
        while _metric(url, "pask_slots_busy") and time.monotonic() < deadline:  # dropped streams wind down
            time.sleep(0.2)
        rss_end = proc_memory(proc.pid)
        errors = _metric(url, 'pask_requests_finished_total{reason="error"}')
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            health = json.loads(r.read())
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    wall = time.monotonic() - t0

    by_kind: dict[str, Counter] = {}
    for kind, ok, _ in results:
        by_kind.setdefault(kind, Counter())["pass" if ok else "fail"] += 1
    failures = [(k, d) for k, ok, d in results if not ok]
    rss_growth = (rss_end - rss_warm) / rss_warm if rss_warm else None
    checks = {
        "every request answered as expected": not failures,
        "no failed request in the server": errors == 0,
        f"RSS within {args.rss_tolerance:.0%} of warm-up": rss_growth is not None and rss_growth <= args.rss_tolerance,
        "finished within --max-seconds": not stopped,
        "server still healthy": health.get("status") == "ok",
    }
    out = {"requests": len(results), "wall_s": wall, "batch": not args.no_batch, "method": args.method,
           "slots": health.get("slots"), "by_kind": {k: dict(v) for k, v in by_kind.items()},
           "failures": failures[:20], "server_errors": errors, "rss_after_warmup": rss_warm, "rss_end": rss_end,
           "rss_growth": rss_growth, "checks": checks}
    con = Console()
    t = Table(title=f"soak: {len(results)} requests in {wall:.0f} s, {args.concurrency} at a time")
    for col in ("kind", "passed", "failed"):
        t.add_column(col)
    for k in MIX:
        if k in by_kind:
            t.add_row(k, str(by_kind[k]["pass"]), str(by_kind[k]["fail"]))
            by_kind.pop(k)
    con.print(t)
    con.print(f"RSS after warm-up {rss_warm / 2**20:.1f} MiB, at the end {rss_end / 2**20:.1f} MiB "
              f"({(rss_growth or 0) * 100:+.2f}%); server-side failed requests: {errors:.0f}")
    for name, ok in checks.items():
        con.print(f"{'ok  ' if ok else 'FAIL'} {name}", markup=False)
    for k, d in failures[:5]:
        con.print(f"  {k}: {d}", markup=False)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
