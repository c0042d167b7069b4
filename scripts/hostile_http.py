"""Hostile HTTP against a real `pask-local serve` on 127.0.0.1: the probes an outside tester runs.

Starts the server as a subprocess (with --api-key, short --header-timeout / --body-timeout and a small
--max-connections), then sends: a cross-site text/plain POST, foreign Host headers (DNS rebinding),
missing and wrong API keys, 5,000-digit integers, bodies of many MiB of words from concurrent
clients (RSS before/after, and a normal request's latency before and during), a slowloris client
(headers a byte at a time), a body that never finishes, a client that closes mid-body, and more
connections than allowed. Each row records what came back and whether it is what a safe server
answers; the server's log must hold no traceback and one line per client fault. Prints a markdown
table; ``--json FILE`` writes the rows. Exit status 1 if any row fails.

    .venv/bin/python scripts/hostile_http.py --model gemma3-270m --fast     # the bounded form CI runs
    .venv/bin/python scripts/hostile_http.py --model qwen2.5-coder-0.5b     # 16 clients x 10 MiB
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loopback import free_port, proc_memory  # (scripts/ is on sys.path when run as a script)

EXE = str(Path(sys.executable).with_name("pask-local"))
KEY = "hostile-probe-key"
HEADER_TIMEOUT, BODY_TIMEOUT = 2.0, 3.0


@dataclass
class Row:
    probe: str
    expected: str
    got: str
    ok: bool
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class Target:
    """The server under test: where it listens, its process, its log."""

    def __init__(self, port: int, proc: subprocess.Popen[bytes], log: Path, max_connections: int) -> None:
        self.port, self.proc, self.log, self.max_connections = port, proc, log, max_connections
        self.model_id = ""

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                key: bool = True, timeout: float = 120) -> tuple[int, dict[str, Any] | str]:
        h = {"Content-Type": "application/json"} if body is not None else {}
        if key:
            h["Authorization"] = f"Bearer {KEY}"
        h.update(headers or {})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            text = r.read().decode("utf-8", "replace")
        finally:
            conn.close()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


def chat_body(model: str, content: str = "What is the weather in Oslo?", **extra: Any) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                           "required": ["location"]}}}
    return {"model": model, "messages": [{"role": "user", "content": content}], "tools": [tool],
            "tool_choice": "required", "max_tokens": 16, **extra}


def code_of(reply: dict[str, Any] | str) -> str:
    return reply.get("error", {}).get("code") or "" if isinstance(reply, dict) else ""


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


# ------------------------------------------------------------------ probes
def probe_csrf(t: Target) -> list[Row]:
    body = json.dumps(chat_body(t.model_id)).encode()
    status, reply = t.request("POST", "/v1/chat/completions", body, {"Content-Type": "text/plain"})
    return [Row("cross-site POST, Content-Type text/plain", "415, nothing generated", f"{status} {code_of(reply)}",
                status == 415)]


def probe_hosts(t: Target) -> list[Row]:
    rows = []
    for host in ("attacker.example", "attacker.example:8000", "127.0.0.1.nip.io"):
        status, reply = t.request("GET", "/v1/models", headers={"Host": host})
        rows.append(Row(f"Host: {host} (DNS rebinding)", "403", f"{status} {code_of(reply)}", status == 403))
    status, reply = t.request("POST", "/v1/chat/completions", json.dumps(chat_body(t.model_id)).encode(),
                              {"Host": "attacker.example"})
    rows.append(Row("POST with Host: attacker.example", "403", f"{status} {code_of(reply)}", status == 403))
    status, _ = t.request("GET", "/v1/models", headers={"Host": f"localhost:{t.port}"})
    rows.append(Row(f"Host: localhost:{t.port}", "200", str(status), status == 200))
    return rows


def probe_keys(t: Target) -> list[Row]:
    rows = []
    status, reply = t.request("GET", "/v1/models", key=False)
    rows.append(Row("no API key", "401", f"{status} {code_of(reply)}", status == 401))
    status, reply = t.request("GET", "/v1/models", key=False, headers={"Authorization": "Bearer wrong"})
    rows.append(Row("wrong API key", "401", f"{status} {code_of(reply)}", status == 401))
    status, _ = t.request("GET", "/health", key=False)
    rows.append(Row("/health without a key", "200", str(status), status == 200))
    return rows


def probe_big_ints(t: Target) -> list[Row]:
    rows = []
    digits = "9" * 5000
    for key in ("seed", "max_tokens"):
        raw = json.dumps(chat_body(t.model_id)).encode()[:-1] + f', "{key}": {digits}}}'.encode()
        status, reply = t.request("POST", "/v1/chat/completions", raw)
        rows.append(Row(f"{key} of 5,000 digits", "400", f"{status} {code_of(reply)}", status == 400))
    return rows


def probe_flood(t: Target, clients: int, mib: int) -> list[Row]:
    """``clients`` concurrent bodies of ``mib`` MiB of words; a normal request's latency before and during."""
    words = ("lorem ipsum dolor sit amet " * (mib * (1 << 20) // 27 + 1))[: mib << 20]
    body = json.dumps(chat_body(t.model_id, words)).encode()

    def normal() -> float:
        (status, _), s = timed(lambda: t.request("POST", "/v1/chat/completions", json.dumps(chat_body(t.model_id)).encode()))
        return s if status == 200 else float("nan")

    before = normal()
    rss0 = proc_memory(t.proc.pid)
    results: list[tuple[int, str, bool, float]] = []
    peak = [rss0]
    lock = threading.Lock()

    def one() -> None:
        try:
            (status, reply), s = timed(lambda: t.request("POST", "/v1/chat/completions", body))
        except OSError as exc:
            with lock:
                results.append((0, type(exc).__name__, False, 0.0))
            return
        # refused by size before rendering (its message), or 429 while others are read
        early = status == 429 or (status == 400 and "non-blank characters" in str(reply))
        with lock:
            results.append((status, code_of(reply), early, s))

    def watch(stop: threading.Event) -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc_memory(t.proc.pid))
            time.sleep(0.05)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    threads = [threading.Thread(target=one) for _ in range(clients)]
    for th in threads:
        th.start()
    during = normal()
    for th in threads:
        th.join()
    stop.set()
    watcher.join()
    early = sum(1 for r in results if r[2])
    slowest = max(r[3] for r in results)
    grow = (peak[0] - rss0) / (1 << 20)
    bound = 64 + clients * mib * 4  # the raw bodies and their parsed text, nothing per token
    return [
        Row(f"{clients} clients x {mib} MiB of words", "each 400 before tokenizing",
            f"{early} of {len(results)} early: {sorted({f'{s} {c}' for s, c, _, _ in results})}",
            early == len(results) == clients and slowest < 30,
            slowest, {"slowest_s": round(slowest, 2)}),
        Row("RSS during the flood", f"grows < {bound} MiB", f"+{grow:.0f} MiB (peak {peak[0] / (1 << 20):.0f} MiB)",
            grow < bound, extra={"rss_before_mib": rss0 >> 20, "rss_peak_mib": peak[0] >> 20}),
        Row("a normal request during the flood", "answered, not refused (latency reported)",
            f"{before:.2f} s before, {during:.2f} s during", during == during,
            extra={"before_s": round(before, 3), "during_s": round(during, 3)}),
    ]


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, float]:
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        data = sock.recv(65536)
        while data:
            data = sock.recv(65536)
        return True, time.monotonic() - t0
    except TimeoutError:
        return False, time.monotonic() - t0
    except OSError:
        return True, time.monotonic() - t0


def probe_slowloris(t: Target) -> list[Row]:
    s = socket.create_connection(("127.0.0.1", t.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    closed, waited = _closed_within(s, HEADER_TIMEOUT + 5)
    s.close()
    return [Row("headers never finished (slowloris)", f"closed after ~{HEADER_TIMEOUT:g} s",
                f"{'closed' if closed else 'still open'} after {waited:.1f} s", closed, waited)]


def probe_slow_body(t: Target) -> list[Row]:
    s = socket.create_connection(("127.0.0.1", t.port))
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n{{\"model\"".encode())
    s.settimeout(BODY_TIMEOUT + 10)
    t0 = time.monotonic()
    try:
        head = s.recv(4096).decode("latin-1")
    except OSError:
        head = ""
    waited = time.monotonic() - t0
    s.close()
    status = head.split(" ", 2)[1] if head.startswith("HTTP/") else "no reply"
    return [Row("a body that never finishes", f"408 after ~{BODY_TIMEOUT:g} s", f"{status} after {waited:.1f} s",
                status == "408", waited)]


def probe_disconnect(t: Target) -> list[Row]:
    s = socket.create_connection(("127.0.0.1", t.port))
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {KEY}\r\nContent-Length: 100000\r\n\r\n{{\"messages\": [".encode())
    time.sleep(0.3)
    s.close()
    time.sleep(1.0)
    status, _ = t.request("GET", "/health")
    return [Row("client closes mid-body", "one log line, server goes on", f"health {status}", status == 200)]


def probe_connections(t: Target) -> list[Row]:
    idle = [socket.create_connection(("127.0.0.1", t.port)) for _ in range(t.max_connections)]
    for s in idle:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # unfinished headers hold the connection
    time.sleep(0.3)
    try:
        status, _ = t.request("GET", "/health", timeout=10)
        got = str(status)
    except OSError as exc:
        status, got = 0, type(exc).__name__
    for s in idle:
        s.close()
    return [Row(f"{t.max_connections} held connections, then one more", "503 (limit), not a hang", got,
                status == 503)]


def check_log(t: Target, faults_at_least: int) -> list[Row]:
    text = t.log.read_text(errors="replace")
    faults = text.count("client fault from")
    return [Row("server log", "no traceback", "traceback" if "Traceback" in text else "none",
                "Traceback" not in text),
            Row("server log", f">= {faults_at_least} one-line client faults", f"{faults} lines",
                faults >= faults_at_least)]


# ------------------------------------------------------------------ driver
def start(args: argparse.Namespace, log: Path, max_connections: int) -> Target:
    port = free_port()
    cmd = [EXE, "serve", "--port", str(port), "--api-key", KEY, "--header-timeout", str(HEADER_TIMEOUT),
           "--body-timeout", str(BODY_TIMEOUT), "--max-connections", str(max_connections), "--slots", "1",
           "--max-context", "2048", "--queue", "4", "--log-level", "warning"]
    cmd += ["--gguf", args.gguf] if args.gguf else ["--model", args.model]
    env = {**os.environ, "PASK_THREADS": os.environ.get("PASK_THREADS", "1")}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"), env=env)
    t = Target(port, proc, log, max_connections)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited ({proc.returncode}): {log.read_text()[-500:]}")
        try:
            if t.request("GET", "/health", timeout=2)[0] == 200:
                models = t.request("GET", "/v1/models")[1]
                t.model_id = models["data"][0]["id"] if isinstance(models, dict) else ""
                return t
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("error: the server did not start within 300 s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--gguf")
    ap.add_argument("--fast", action="store_true", help="the bounded form: 4 clients x 4 MiB")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    clients, mib = (4, 4) if args.fast else (16, 10)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        t = start(args, log, max_connections=clients + 8)  # room for the flood and a normal request
        rows: list[Row] = []
        try:
            for probe in (probe_csrf, probe_hosts, probe_keys, probe_big_ints, probe_slowloris, probe_slow_body,
                          probe_disconnect, probe_connections):
                rows += probe(t)
            rows += probe_flood(t, clients, mib)
        finally:
            t.proc.terminate()
            try:
                t.proc.wait(20)
            except subprocess.TimeoutExpired:
                t.proc.kill()
        rows += check_log(t, faults_at_least=sum(1 for r in rows if r.expected.split()[0] in
                                                  ("401", "403", "415", "400", "408")))
    print("| probe | expected | got | ok |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r.probe} | {r.expected} | {r.got} | {'yes' if r.ok else '**NO**'} |")
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
