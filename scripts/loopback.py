"""Helpers the serving scripts share: a free loopback port, a process's memory from /proc."""

from __future__ import annotations

import re
import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def proc_memory(pid: int, field: str = "VmRSS") -> int:
    """Bytes of ``field`` (VmRSS: resident now, VmHWM: peak resident) of process ``pid``; 0 if unknown."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    m = re.search(rf"^{field}:\s+(\d+) kB", text, flags=re.M)
    return int(m.group(1)) * 1024 if m else 0
