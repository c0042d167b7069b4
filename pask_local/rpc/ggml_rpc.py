"""ctypes bindings of ggml's RPC backend and the few ggml device calls around it.

The RPC backend is compiled into the wheel's ggml (``GGML_RPC=ON``, scripts/build_llama.py); its entry
points are reached the way llama.cpp's own tools reach them, through the registry: the backend named
"RPC" and its proc addresses ``ggml_backend_rpc_add_server`` (client) and
``ggml_backend_rpc_start_server`` (server). A build without it makes ``available()`` false and every
other call an ``RpcError``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any

from ..errors import NativeError, RpcError

DEV_TYPE_GPU = 1    # ggml_backend_dev_type: GGML_BACKEND_DEVICE_TYPE_GPU
DEV_TYPE_IGPU = 2   # GGML_BACKEND_DEVICE_TYPE_IGPU
DEV_TYPE_CPU = 0

ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
START_SERVER = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                ctypes.POINTER(ctypes.c_void_p))
LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
NO_RPC = "this llama.cpp build has no RPC backend; rebuild it: python scripts/build_llama.py (GGML_RPC=ON)"


def _declare(lib: ctypes.CDLL, name: str, restype: Any, argtypes: list[Any]) -> Any:
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


@functools.cache
def _ggml() -> ctypes.CDLL:
    """The ggml library the installed llama_cpp loaded (registry, devices, logging, abort hook)."""
    try:
        import llama_cpp._ggml as g
        import llama_cpp.llama_cpp  # noqa: F401  - loads libllama, which registers the backends
    except Exception as exc:  # ImportError, OSError from a broken shared library
        raise NativeError(f"cannot import llama_cpp ({exc}); run scripts/setup") from None
    lib = g.libggml
    _declare(lib, "ggml_backend_reg_by_name", ctypes.c_void_p, [ctypes.c_char_p])
    _declare(lib, "ggml_backend_reg_get_proc_address", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p])
    _declare(lib, "ggml_backend_reg_dev_count", ctypes.c_size_t, [ctypes.c_void_p])
    _declare(lib, "ggml_backend_reg_dev_get", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t])
    _declare(lib, "ggml_backend_dev_count", ctypes.c_size_t, [])
    _declare(lib, "ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t])
    _declare(lib, "ggml_backend_dev_type", ctypes.c_int, [ctypes.c_void_p])
    _declare(lib, "ggml_backend_dev_by_type", ctypes.c_void_p, [ctypes.c_int])
    _declare(lib, "ggml_backend_dev_name", ctypes.c_char_p, [ctypes.c_void_p])
    _declare(lib, "ggml_log_set", None, [LOG_CALLBACK, ctypes.c_void_p])
    _declare(lib, "ggml_set_abort_callback", ctypes.c_void_p, [ABORT_CALLBACK])
    return lib


def _rpc_reg() -> int | None:
    return _ggml().ggml_backend_reg_by_name(b"RPC")


def available() -> bool:
    """Whether the installed build has the RPC backend."""
    return _rpc_reg() is not None


def _proc(name: str) -> int:
    reg = _rpc_reg()
    if reg is None:
        raise RpcError(NO_RPC)
    addr = _ggml().ggml_backend_reg_get_proc_address(reg, name.encode())
    if not addr:
        raise RpcError(f"the RPC backend of this build lacks {name}")
    return addr


_ADDED: set[str] = set()   # endpoints whose devices this process has (ggml-rpc keeps them for its life)


def add_server(endpoint: str) -> list[int]:
    """The devices (ggml_backend_dev_t) of the RPC server at ``endpoint`` ("host:port"); it must answer
    (``probe.hello`` first: ggml-rpc aborts the process on a server it cannot reach)."""
    lib = _ggml()
    reg = ADD_SERVER(_proc("ggml_backend_rpc_add_server"))(endpoint.encode())
    if not reg:
        raise RpcError(f"RPC server {endpoint} offers no device")
    _ADDED.add(endpoint)
    return [lib.ggml_backend_reg_dev_get(reg, i) for i in range(lib.ggml_backend_reg_dev_count(reg))]


def added(endpoint: str) -> bool:
    """Whether this process already uses ``endpoint`` (a model on it may hold the server's one connection)."""
    return endpoint in _ADDED


def local_gpus() -> list[int]:
    """This machine's GPU devices (a CUDA build's), in registry order; none on a CPU build."""
    lib = _ggml()
    devs = (lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count()))
    return [d for d in devs if lib.ggml_backend_dev_type(d) in (DEV_TYPE_GPU, DEV_TYPE_IGPU)]


def device_name(dev: int) -> str:
    return _ggml().ggml_backend_dev_name(dev).decode()


def cpu_device() -> int:
    dev = _ggml().ggml_backend_dev_by_type(DEV_TYPE_CPU)
    if not dev:
        raise NativeError("ggml has no CPU device")
    return dev


def start_server(endpoint: str, n_threads: int, devices: list[int]) -> None:
    """Serve ``devices`` at ``endpoint`` (blocks for the life of the server; returns if it cannot listen)."""
    fn = START_SERVER(_proc("ggml_backend_rpc_start_server"))
    arr = (ctypes.c_void_p * len(devices))(*devices)
    fn(endpoint.encode(), None, n_threads, len(devices), arr)


_KEEP: list[Any] = []   # ctypes callbacks handed to C must outlive every call into them


def set_log_callback(fn: Any) -> None:
    """Route every ggml log line to ``fn(level, text)`` (replaces llama_cpp's own callback)."""
    cb = LOG_CALLBACK(lambda level, text, _ud: fn(level, (text or b"").decode("utf-8", "replace")))
    _KEEP.append(cb)
    _ggml().ggml_log_set(cb, None)


_ENDPOINTS: list[str] = []   # the servers this process uses, named when one is lost


def exit_on_rpc_abort(endpoints: tuple[str, ...]) -> None:
    """Turn ggml-rpc's abort on a lost server into one line on stderr and exit status 1.

    The RPC client cannot return an error to its caller: a server that dies or stops answering
    (past PASK_RPC_TIMEOUT_MS, patch 0009) makes it call ggml_abort, which would dump a backtrace and
    a core. Any other abort keeps ggml's default report."""
    _ENDPOINTS.extend(e for e in endpoints if e not in _ENDPOINTS)
    _install_abort_hook()


@functools.cache
def _install_abort_hook() -> None:
    def on_abort(message: bytes | None) -> None:
        text = (message or b"").decode("utf-8", "replace")
        if "RPC" not in text:
            print(text, file=sys.stderr, flush=True)
            return   # ggml_abort goes on to abort()
        detail = text.split(": ", 1)[-1].strip()   # drop ggml's "file:line: " prefix
        print(f"error: lost an RPC server of {', '.join(_ENDPOINTS)} ({detail})", file=sys.stderr, flush=True)
        os._exit(1)

    cb = ABORT_CALLBACK(on_abort)
    _KEEP.append(cb)
    _ggml().ggml_set_abort_callback(cb)
