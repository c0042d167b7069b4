"""llama.cpp's RPC backend on loopback (docs/rpc.md): two ``pask-local rpc-server`` processes on free
127.0.0.1 ports take the last layers of Gemma 3 270M half each, the rest stay on the local CPU.

At budget 1.0 (and Full KV) the greedy tokens equal the single-process run's; at 0.33 every layer
stays within its allowance and each server's K/V bytes, as the server itself reports them
(``--report``), fall to about a third of Full KV's there. A server that is unreachable, that dies
mid-run or that stops answering ends the client with one line and exit status 1, within the timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from pask_local.errors import PaskError, RpcError
from pask_local.rpc import ggml_rpc
from pask_local.rpc.endpoints import is_loopback, parse_endpoints, parse_tensor_split

OFFLOADED = 12          # of Gemma 3 270M's 18 layers + output: 6 per server (the output on the last), 7 local
# a 160-token prompt: capacities rounded to 16 cells with 16-token prefill chunks (the slack every layer
# may exceed its allowance by), so that a 0.33 budget shows in each layer's capacity
SMALL = {"cell_align": 16, "chunk": 16}
REQUEST = "What is the weather like in Paris today? Answer in celsius."
PASKLOCAL = str(Path(sys.executable).parent / "pask-local")

needs_rpc = pytest.mark.skipif(not ggml_rpc.available(),
                               reason="this llama.cpp build has no RPC backend (scripts/build_llama.py builds "
                                      "it with GGML_RPC=ON)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``pask-local rpc-server`` subprocess on a free loopback port with a memory report."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.port = _free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.report = tmp / f"{name}.json"
        self.log = tmp / f"{name}.log"   # a file, not a pipe: nobody reads it while the server runs
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([PASKLOCAL, "rpc-server", "--port", str(self.port), "--threads", "1",
                                          "--report", str(self.report)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.report.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"rpc-server did not start: {self.tail()}")
            time.sleep(0.05)

    def tail(self) -> str:
        """The end of the server's own output (for a failure's message)."""
        return f"rpc-server {self.endpoint} (exit {self.proc.poll()}): {self.log.read_text()[-3000:]}"

    def memory(self) -> dict:
        return json.loads(self.report.read_text())

    def wait_for(self, pred, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = self.memory()
            if pred(snap):
                return snap
            time.sleep(0.02)
        raise AssertionError(f"{self.endpoint}: report never matched: {self.memory()}; {self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def server_factory(tmp_path):
    started: list[Server] = []

    def start(name: str) -> Server:
        started.append(Server(tmp_path, name))
        return started[-1]

    yield start
    for s in started:
        print(s.tail())   # pytest shows it when the test failed
        s.stop()


def test_endpoint_and_split_parsing():
    assert parse_endpoints(" 127.0.0.1:50052, box:7 ") == ("127.0.0.1:50052", "box:7")
    assert parse_tensor_split("3,1") == (3.0, 1.0)
    for bad in ("127.0.0.1", "h:0", "h:70000", "[::1]:5", "a:1,a:1", ""):
        with pytest.raises(RpcError):
            parse_endpoints(bad)
    for bad in ("1,x", "0,0", "-1,2", "nan"):
        with pytest.raises(RpcError):
            parse_tensor_split(bad)
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")


def test_placement_options_are_checked(monkeypatch):
    from pask_local.cli_options import make_placement
    from pask_local.rpc import probe

    assert make_placement(None, None, 0, 60.0) is None
    with pytest.raises(RpcError, match="127.0.0.1:1 is unreachable"):   # nothing listens on port 1
        make_placement("127.0.0.1:1", None, -1, 5.0)
    asked: list[str] = []
    monkeypatch.setattr(probe, "hello", lambda endpoint, timeout: asked.append(endpoint) or (7, 0, 0))
    p = make_placement("127.0.0.1:1,127.0.0.1:2", "3,1", -1, 5.0)
    assert p.rpc == ("127.0.0.1:1", "127.0.0.1:2") and p.tensor_split == (3.0, 1.0) and p.n_layers == -1
    assert asked == ["127.0.0.1:1", "127.0.0.1:2"]
    for args, match in ((("127.0.0.1:1", None, 0, 60.0), "give --ngl"), ((None, "1,1", 4, 60.0), "add --rpc"),
                        (("127.0.0.1:1", None, 4, 0.0), "--rpc-timeout")):
        with pytest.raises(PaskError, match=match):
            make_placement(*args)


def test_ledger_counts_a_clients_buffers_from_the_server_log(tmp_path):
    """The server's memory report: allocations minus frees, cleared buffers as K/V, reset per client."""
    from pask_local.rpc.server import Ledger

    report = tmp_path / "mem.json"
    led = Ledger("127.0.0.1:1", report)
    log = ["[hello] version: 7.0.0\n",
           "[alloc_buffer] device: 0, size: 1000 -> remote_ptr: a1, remote_size: 1024\n",
           "[alloc_buffer] device: 0, size: 500 -> remote_ptr: b2, remote_size: 512\n",
           "[buffer_clear] remote_ptr: b2, value: 0\n",
           "[set_tensor] buffer: 0x1, data: 0x2, offset: 0, size: 4\n"]
    for line in log:
        led.on_log(1, line)
    snap = json.loads(report.read_text())
    assert (snap["buffers"], snap["buffer_bytes"], snap["kv_bytes"], snap["clients"]) == (2, 1536, 512, 1)
    led.on_log(1, "[free_buffer] remote_ptr: b2\n")
    assert json.loads(report.read_text())["kv_bytes"] == 0
    assert json.loads(report.read_text())["peak_kv_bytes"] == 512
    led.on_log(1, "[hello] version: 7.0.0\n")   # a new client: the last one's buffers were freed with it
    led.on_closed()                               # the first client's late "closed" line changes nothing
    led.on_log(1, "[alloc_buffer] device: 0, size: 8 -> remote_ptr: c3, remote_size: 8\n")
    assert json.loads(report.read_text())["buffer_bytes"] == 8
    led.on_closed()                               # the second client left
    assert json.loads(report.read_text())["buffer_bytes"] == 0


def test_ledger_reports_from_several_threads_at_once(tmp_path):
    """ggml's serving thread, the stdout pump and the main thread all rewrite the report: no write may
    lose its temporary file to another (a server once died of that right after its readiness check)."""
    import threading

    from pask_local.rpc.server import Ledger

    led = Ledger("127.0.0.1:1", tmp_path / "mem.json")
    errors: list[BaseException] = []

    def hammer(k: int) -> None:
        try:
            for i in range(300):
                led.on_log(1, f"[alloc_buffer] device: 0, size: 8 -> remote_ptr: {k:x}{i:04x}, remote_size: 8\n")
                led.write()
        except BaseException as exc:   # noqa: BLE001 - the thread's failure is the test's
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(k + 1,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert json.loads((tmp_path / "mem.json").read_text())["buffers"] == 4 * 300


@pytest.mark.slow
@needs_rpc
def test_split_over_two_servers_matches_one_process_and_cuts_each_servers_kv(gemma_path, gemma_model,
                                                                              server_factory):
    from pask_local.engine import Engine, EngineConfig, make_method
    from pask_local.llm import Model
    from pask_local.messages import user_message
    from pask_local.rpc.placement import Placement
    from pask_local.schema.tools import read_tools

    tools = read_tools(REPO / "examples" / "get_weather.json")
    snaps: list[list[dict]] = []

    def run(model, method: str, budget: float, servers=()):
        """A greedy run; each server's report is read at the first token, while the run's K/V lives."""
        def on_token(_token: int) -> bool:
            if len(snaps) == n_before:
                snaps.append([s.memory() for s in servers])
            return False

        n_before = len(snaps)
        engine = Engine(model, make_method(method, model), EngineConfig(budget=budget, max_tokens=40, **SMALL))
        return engine.chat(user_message(REQUEST), tools, "required", on_token=on_token if servers else None)

    local = run(gemma_model, "full", 1.0).tokens   # the single-process run (budget 1.0 == Full KV: test_engine)
    servers = [server_factory("a"), server_factory("b")]
    placement = Placement(n_layers=OFFLOADED, rpc=tuple(s.endpoint for s in servers), tensor_split=(1.0, 1.0))
    model = Model(gemma_path, placement=placement)
    try:
        weights = [s.memory()["buffer_bytes"] for s in servers]
        assert all(w > 1 << 20 for w in weights), weights   # each server holds its layers' weights
        full = run(model, "full", 1.0, servers)
        assert full.tokens == local
        assert run(model, "pask-prior", 1.0, servers).tokens == local
        part = run(model, "pask-prior", 0.33, servers)
        # a second model on the same servers while the first holds their one connection (eval loads one
        # per generator): no handshake of its own, it shares the connection
        Model(gemma_path, placement=placement).close()
        for s in servers:   # the run's context is closed: its K/V buffers leave the server with it
            s.wait_for(lambda m: m["kv_bytes"] == 0, timeout=10)
    finally:
        model.close()
    full_kv, one_kv, part_kv = ([m["kv_bytes"] for m in snap] for snap in snaps)
    print(f"server K/V bytes: full {full_kv}, pask-prior@1.0 {one_kv}, @0.33 {part_kv}; client K/V "
          f"{full.stats['kv_bytes_allocated']} -> {part.stats['kv_bytes_allocated']}")
    assert all(kv > 0 for kv in full_kv)
    assert part.stats["max_over_budget_entries"] <= 0   # every layer within its allowance at every step
    for f, p in zip(full_kv, part_kv, strict=True):
        assert 0.3 <= p / f <= 0.45, (f, p)   # 0.375 here: 96 of 256 cells per layer


@pytest.mark.slow
@needs_rpc
def test_unreachable_server_is_one_line(gemma_path):
    port = _free_port()   # nothing listens there
    t0 = time.monotonic()
    out = run_cli("run", "--gguf", str(gemma_path), "--rpc", f"127.0.0.1:{port}", "--ngl", "-1", "--schema",
                  str(REPO / "examples" / "get_weather.json"), REQUEST, timeout=60)
    assert out.returncode == 1
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "unreachable" in lines[0], out.stderr
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
@needs_rpc
@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_server_lost_mid_run_is_one_line(gemma_path, server_factory, fault):
    server = server_factory(fault)
    env = dict(os.environ)
    client = subprocess.Popen([PASKLOCAL, "run", "--gguf", str(gemma_path), "--rpc", server.endpoint, "--ngl", "-1",
                               "--rpc-timeout", "3", "--max-tokens", "256", "--schema",
                               str(REPO / "examples" / "get_weather.json"), REQUEST],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        server.wait_for(lambda m: m["kv_bytes"] > 0)   # the context is on the server: the run has begun
        os.kill(server.proc.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        t0 = time.monotonic()
        stdout, stderr = client.communicate(timeout=30)
        waited = time.monotonic() - t0
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        if fault == "stopped":
            os.kill(server.proc.pid, signal.SIGCONT)
    assert client.returncode == 1, stderr
    assert stdout == ""                        # no partial call on stdout
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and f"lost an RPC server of {server.endpoint}" in lines[0], stderr
    assert waited < 3 + 10


@pytest.mark.slow
@needs_rpc
def test_compress_over_rpc_writes_the_same_prefix_a_local_run_restores(gemma_path, server_factory, tmp_path):
    """``compress --rpc``: the offloaded layers' K/V are read back from the server into the file, which
    keeps the positions a local compression keeps (a planned method decides from the classes alone)
    and which a run without --rpc restores. An unreachable server: one line, no file."""
    from pask_local.prefix.file import read

    tools = str(REPO / "examples" / "get_weather.json")
    server = server_factory("c")
    local, remote = tmp_path / "local.pkv", tmp_path / "remote.pkv"
    common = ("compress", "--gguf", str(gemma_path), "--tools", tools, "--budget", "0.33", "--method", "pask-prior")
    done = run_cli(*common, "--out", str(local), timeout=300)
    assert done.returncode == 0, done.stderr
    done = run_cli(*common, "--out", str(remote), "--rpc", server.endpoint, "--ngl", "-1", timeout=300)
    assert done.returncode == 0, done.stderr + server.tail()
    assert json.loads(done.stdout)["held_share"] < 0.5
    assert server.memory()["peak_kv_bytes"] > 0   # the layers' K/V did live on the server
    a, b = read(local, 1 << 30)[0], read(remote, 1 << 30)[0]
    assert b.kept == a.kept and b.tokens == a.tokens and b.model_sha256 == a.model_sha256
    out = run_cli("run", "--gguf", str(gemma_path), "--prefix", str(remote), "--budget", "0.33", "--method",
                  "pask-prior", "--schema", tools, REQUEST, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["name"] == "get_weather"
    gone = tmp_path / "never.pkv"
    out = run_cli(*common, "--out", str(gone), "--rpc", f"127.0.0.1:{_free_port()}", "--ngl", "-1", timeout=60)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1 and "unreachable" in out.stderr
    assert not gone.exists()
