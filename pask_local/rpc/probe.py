"""Checks that an RPC server answers before ggml-rpc connects to it.

ggml-rpc's client aborts the whole process when a server refuses the connection or fails the
handshake, and blocks for minutes on an address that drops packets. ``hello`` opens its own TCP
connection with a deadline, sends the protocol's HELLO command and reads the version, so a wrong or
dead endpoint is one ``RpcError`` line instead. A server serves one client at a time: one busy with
another client accepts the connection but does not answer, which the deadline turns into an error.
"""

from __future__ import annotations

import socket
import struct

from ..errors import RpcError

CMD_HELLO = 14          # rpc_cmd RPC_CMD_HELLO (fixed across protocol versions)
CAPS_SIZE = 24          # RPC_CONN_CAPS_SIZE: the hello request's capability bytes (none offered here)
PROTO_MAJOR = 7         # RPC_PROTO_MAJOR_VERSION of the vendored ggml-rpc
RESPONSE_SIZE = 4 + CAPS_SIZE


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed the connection")
        data += chunk
    return data


def hello(endpoint: str, timeout: float) -> tuple[int, int, int]:
    """The (major, minor, patch) protocol version of the server at ``endpoint``; RpcError otherwise."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(struct.pack("<BQ", CMD_HELLO, CAPS_SIZE) + bytes(CAPS_SIZE))
            (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
            if size != RESPONSE_SIZE:
                raise RpcError(f"{endpoint} is not a ggml RPC server of this protocol (hello of {size} bytes)")
            major, minor, patch = _recv_exact(sock, RESPONSE_SIZE)[:3]
    except TimeoutError:
        raise RpcError(f"RPC server {endpoint} did not answer within {timeout:g} s (down, firewalled, or "
                       "busy with another client)") from None
    except OSError as exc:   # refused, reset, no route, unknown host, closed mid-hello
        reason = exc.strerror or str(exc)
        raise RpcError(f"RPC server {endpoint} is unreachable ({reason})") from None
    if major != PROTO_MAJOR:
        raise RpcError(f"RPC server {endpoint} speaks protocol {major}.{minor}.{patch}, this build {PROTO_MAJOR}.x")
    return major, minor, patch
