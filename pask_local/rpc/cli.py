"""The ``pask-local rpc-server`` command (mounted by ``pask_local/cli.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from ..errors import PaskError


def rpc_server_command(
    host: Annotated[str, typer.Option("--host", help="IPv4 address to listen on. Anything but loopback exposes "
                                      "this process to the network: RPC has no authentication.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port to listen on.")] = 50052,
    threads: Annotated[int, typer.Option("--threads", help="CPU threads for the graphs it computes (0: all "
                                         "cores).")] = 0,
    report: Annotated[Path | None, typer.Option("--report", help="Keep this server's memory (buffers, K/V "
                                                "bytes, peaks, RSS) as JSON in FILE, rewritten on every "
                                                "change.", show_default=False)] = None,
) -> None:
    """Serve this machine's CPU to a client's --rpc (llama.cpp's RPC backend), one client at a time.

    Example: pask-local rpc-server --port 50052, then on the client:
    pask-local run --rpc 127.0.0.1:50052 --ngl -1 --schema tools.json "..."
    """
    import ipaddress

    from .server import serve

    if not 1 <= port <= 65535:
        raise PaskError(f"--port must be in 1..65535, got {port}")
    if threads < 0:
        raise PaskError(f"--threads must be >= 0, got {threads}")
    if report is not None and not report.parent.is_dir():
        raise PaskError(f"--report: no directory {report.parent}")
    try:
        ipaddress.IPv4Address(host)   # ggml-rpc's server binds a dotted IPv4 address (inet_addr), no names
    except ValueError:
        raise PaskError(f"--host takes an IPv4 address such as 127.0.0.1 or 0.0.0.0, got {host!r}") from None
    serve(host, port, threads or os.cpu_count() or 1, report)
