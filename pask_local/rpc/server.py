"""``pask-local rpc-server``: this machine's CPU as a ggml RPC device for a client's ``--rpc``.

A Python process hands ggml-rpc's own server loop (``ggml_backend_rpc_start_server``) the CPU device
and, meanwhile, keeps a ledger of what it holds: the server logs every handshake and every buffer
it allocates, frees and clears (ggml-rpc's debug log, on with GGML_RPC_DEBUG before the library
loads, delivered on the serving thread as it happens), and prints when a client has left (its
buffers went with it). A buffer its client cleared to zero counts as K/V: llama.cpp zero-fills
exactly its K/V cache buffers when it creates them (weights and compute buffers are never cleared). ``--report FILE`` keeps the ledger as JSON, rewritten atomically
on every change, so a test or a user reads this server's memory from the server itself.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TextIO

from ..errors import RpcError
from .endpoints import is_loopback

DEBUG_ENV = "GGML_RPC_DEBUG"
LOG_ERROR = 4   # ggml_log_level GGML_LOG_LEVEL_ERROR
ALLOC = re.compile(r"\[alloc_buffer\].*-> remote_ptr: ([0-9a-f]+), remote_size: (\d+)")
FREE = re.compile(r"\[free_buffer\] remote_ptr: ([0-9a-f]+)")
CLEAR = re.compile(r"\[buffer_clear\] remote_ptr: ([0-9a-f]+)")
HELLO = "[hello]"
CLOSED = "Client connection closed"   # ggml-rpc's stdout line once a client's buffers are freed


class Ledger:
    """The live buffers of this server (remote pointer -> [bytes, cleared]) and their totals."""

    def __init__(self, endpoint: str, report: Path | None) -> None:
        self.endpoint = endpoint
        self.report = report
        self.buffers: dict[str, list] = {}
        self.clients = 0   # handshakes served (this server's own readiness check included)
        self.closed = 0    # of those, connections ggml-rpc reported closed
        self.peak_bytes = 0
        self.peak_kv_bytes = 0
        self._lock = threading.Lock()

    def on_log(self, level: int, text: str) -> None:
        """ggml's log callback: buffer events update the ledger; errors go to stderr; the rest is dropped."""
        if text.startswith(HELLO):   # a new client: the previous one's buffers are freed by now
            with self._lock:
                self.clients += 1
                self.buffers.clear()
                self._changed()
        elif m := ALLOC.search(text):
            with self._lock:
                self.buffers[m.group(1)] = [int(m.group(2)), False]
                self._changed()
        elif m := FREE.search(text):
            with self._lock:
                self.buffers.pop(m.group(1), None)
                self._changed()
        elif m := CLEAR.search(text):
            with self._lock:
                if m.group(1) in self.buffers and not self.buffers[m.group(1)][1]:
                    self.buffers[m.group(1)][1] = True
                    self._changed()
        elif level == LOG_ERROR:
            print(f"rpc-server: {text.rstrip()}", file=sys.stderr, flush=True)

    def on_closed(self) -> None:
        """A client left (read from stdout, late): its buffers are gone, unless a newer client's are here."""
        with self._lock:
            self.closed += 1
            if self.closed == self.clients:
                self.buffers.clear()
                self._changed()

    def snapshot(self) -> dict:
        total = sum(size for size, _ in self.buffers.values())
        kv = sum(size for size, cleared in self.buffers.values() if cleared)
        return {"endpoint": self.endpoint, "pid": os.getpid(), "clients": self.clients,
                "buffers": len(self.buffers), "buffer_bytes": total, "kv_bytes": kv,
                "peak_buffer_bytes": self.peak_bytes, "peak_kv_bytes": self.peak_kv_bytes, "rss_bytes": _rss()}

    def _changed(self) -> None:
        snap = self.snapshot()
        self.peak_bytes = max(self.peak_bytes, snap["buffer_bytes"])
        self.peak_kv_bytes = max(self.peak_kv_bytes, snap["kv_bytes"])
        snap.update(peak_buffer_bytes=self.peak_bytes, peak_kv_bytes=self.peak_kv_bytes)
        self._write(snap)

    def write(self) -> None:
        """Write the report now (from any thread)."""
        with self._lock:
            self._write(self.snapshot())

    def _write(self, snap: dict) -> None:
        # under the lock: ggml's serving thread, the stdout pump and the main thread all report
        if self.report is None:
            return
        tmp = self.report.with_name(self.report.name + ".tmp")
        tmp.write_text(json.dumps(snap) + "\n")
        os.replace(tmp, self.report)   # a reader never sees half a report


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _check_bind(host: str, port: int) -> None:
    """One RpcError line when the address cannot be listened on (ggml-rpc would only print and return)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise RpcError(f"rpc-server cannot listen on {host}:{port} ({exc.strerror or exc})") from None


def _watch_stdout(ledger: Ledger, out: TextIO) -> None:
    """Point fd 1 at a pipe read here: ggml-rpc prints its client events there; they pass through."""
    read_fd, write_fd = os.pipe()
    original = os.dup(1)
    sys.stdout.flush()
    os.dup2(write_fd, 1)
    os.close(write_fd)

    def pump() -> None:
        with os.fdopen(read_fd, "r", errors="replace") as pipe, os.fdopen(original, "w") as real:
            for line in pipe:
                if line.startswith(CLOSED):
                    ledger.on_closed()
                real.write(line)
                real.flush()

    threading.Thread(target=pump, daemon=True).start()
    sys.stdout = out


def serve(host: str, port: int, threads: int, report: Path | None) -> None:
    """Run the server until interrupted (then exit 0), or until it stops listening (exit 1)."""
    if "llama_cpp.llama_cpp" in sys.modules and not os.environ.get(DEBUG_ENV):
        raise RpcError("rpc-server must start before llama_cpp is loaded (it reads GGML_RPC_DEBUG at load)")
    if not is_loopback(host):
        print(f"WARNING: rpc-server listening on {host}:{port}. ggml's RPC protocol has NO authentication and NO "
              "encryption: anyone who can reach this port can read and write this process's buffers and run "
              "computations on it. Bind it only to a trusted private network.", file=sys.stderr, flush=True)
    _check_bind(host, port)
    os.environ[DEBUG_ENV] = "1"   # before ggml-rpc loads: its buffer events feed the ledger
    from . import ggml_rpc, probe

    if not ggml_rpc.available():
        raise RpcError(ggml_rpc.NO_RPC)
    endpoint = f"{host}:{port}"
    ledger = Ledger(endpoint, report)
    ggml_rpc.set_log_callback(ledger.on_log)
    _watch_stdout(ledger, sys.stderr)
    cpu = ggml_rpc.cpu_device()
    worker = threading.Thread(target=ggml_rpc.start_server, args=(endpoint, threads, [cpu]), daemon=True)
    worker.start()
    signal.signal(signal.SIGTERM, _stop)
    try:
        _wait_ready(endpoint, worker, probe)
        ledger.write()
        print(f"pask-local rpc-server: listening on {endpoint} (CPU, {threads} threads)"
              + (f", memory report {report}" if report else ""), file=sys.stderr, flush=True)
        while worker.is_alive():
            worker.join(0.5)
    except KeyboardInterrupt:
        _stop()
    print(f"error: rpc-server on {endpoint} stopped listening", file=sys.stderr, flush=True)
    os._exit(1)


def _stop(*_args: object) -> None:
    """Ctrl-C or SIGTERM: exit 0 at once (the server loop is blocked in accept(); nothing of it needs
    unwinding, and a client's buffers go with the process)."""
    print("pask-local rpc-server: stopped", file=sys.stderr, flush=True)
    os._exit(0)


def _wait_ready(endpoint: str, worker: threading.Thread, probe) -> None:
    """Until the server answers its own handshake (it binds inside ggml-rpc, after printing its banner)."""
    host, _, port = endpoint.rpartition(":")
    target = f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    for _ in range(200):
        if not worker.is_alive():
            raise RpcError(f"rpc-server could not listen on {endpoint}")
        try:
            probe.hello(target, 2.0)
            return
        except RpcError:
            worker.join(0.05)
    raise RpcError(f"rpc-server on {endpoint} did not come up")
