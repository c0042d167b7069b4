"""Parsing of the RPC command-line values: ``--rpc host:port,...`` and ``--tensor-split 1,1``.

ggml-rpc resolves a host with gethostbyname and speaks IPv4 only, so an endpoint is ``HOST:PORT``
with a name or dotted IPv4 address (no brackets, no IPv6). Bad input is one ``RpcError`` line.
"""

from __future__ import annotations

import ipaddress
import math

from ..errors import RpcError

MAX_SERVERS = 16   # GGML_RPC_MAX_SERVERS, and llama.cpp's device limit (llama_max_devices)
LOOPBACK_NAMES = ("localhost",)


def parse_endpoint(text: str) -> str:
    """``host:port`` checked and normalised (surrounding spaces dropped)."""
    item = text.strip()
    host, sep, port = item.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise RpcError(f"--rpc takes host:port entries (port 1-65535), got {item!r}")
    if ":" in host or "[" in host or any(c.isspace() for c in host):
        raise RpcError(f"--rpc host {host!r}: an IPv4 address or a host name (ggml-rpc speaks IPv4)")
    return f"{host}:{int(port)}"


def parse_endpoints(text: str) -> tuple[str, ...]:
    """``host:port,host:port`` -> the endpoints, in order, each once."""
    items = [parse_endpoint(t) for t in text.split(",") if t.strip()]
    if not items:
        raise RpcError("--rpc needs at least one host:port")
    if len(set(items)) != len(items):
        raise RpcError("--rpc names a server twice")
    if len(items) > MAX_SERVERS:
        raise RpcError(f"--rpc takes at most {MAX_SERVERS} servers, got {len(items)}")
    return tuple(items)


def parse_tensor_split(text: str) -> tuple[float, ...]:
    """``1,1`` or ``3,1`` -> the proportions of the offloaded layers each device takes (not all zero)."""
    try:
        parts = tuple(float(t) for t in text.split(","))
    except ValueError:
        raise RpcError(f"--tensor-split takes comma-separated proportions such as 1,1, got {text!r}") from None
    if not parts or any(not math.isfinite(p) or p < 0 for p in parts) or sum(parts) <= 0:
        raise RpcError(f"--tensor-split proportions must be >= 0 and not all 0, got {text!r}")
    if len(parts) > MAX_SERVERS:
        raise RpcError(f"--tensor-split takes at most {MAX_SERVERS} values, got {len(parts)}")
    return parts


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
