"""Where a model's layers live: ``--ngl`` layers offloaded, over the RPC servers of ``--rpc`` (and any
local GPU), in the proportions of ``--tensor-split``; the rest on the local CPU.

A ``Placement`` is plain configuration, handed to ``llm.Model``. ``model_params`` turns it into
llama.cpp's model parameters (``devices``: a NULL-terminated ggml_backend_dev_t array, RPC devices
first, as llama.cpp orders them itself; ``tensor_split``: one proportion per device; ``n_gpu_layers``),
after every server answered a handshake. llama.cpp then gives each layer, and so each layer's K/V
cells (standard and layered cache alike), to that layer's device.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

from ..errors import RpcError

DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "PASK_RPC_TIMEOUT_MS"   # read by ggml-rpc's client sockets (patch 0009)


@dataclass(frozen=True)
class Placement:
    n_layers: int = 0                        # layers offloaded (llama.cpp's n_gpu_layers; -1: all)
    rpc: tuple[str, ...] = ()                # "host:port" RPC servers
    tensor_split: tuple[float, ...] = ()     # proportions per device (RPC devices, then local GPUs); (): by free memory
    timeout_s: float = DEFAULT_TIMEOUT_S     # handshake deadline, and how long an RPC call may stall

    def check(self) -> None:
        """One RpcError line for a placement llama.cpp cannot honour (before anything loads)."""
        if self.rpc and self.n_layers == 0:
            raise RpcError("--rpc places the offloaded layers on the servers: give --ngl N (N layers, the "
                           "last ones; -1: all)")
        if self.tensor_split and not self.rpc:
            raise RpcError("--tensor-split divides the layers among --rpc servers: add --rpc")
        if not 0 < self.timeout_s <= 3600:
            raise RpcError(f"--rpc-timeout must be in (0, 3600] seconds, got {self.timeout_s}")

    def probe(self) -> None:
        """Every server answers the RPC handshake within the timeout (RpcError naming the first that does not).

        A server this process already uses is skipped: it serves one connection at a time, and a model
        loaded here may hold it (a later fault there ends the process: ``ggml_rpc.exit_on_rpc_abort``)."""
        from . import ggml_rpc, probe

        for endpoint in self.rpc:
            if not ggml_rpc.added(endpoint):
                probe.hello(endpoint, self.timeout_s)

    def model_params(self, params: Any) -> list[Any]:
        """Fill llama_model_params ``params``; the ctypes arrays it points to (keep them until the load returns)."""
        from . import ggml_rpc

        self.check()
        params.n_gpu_layers = self.n_layers
        if not self.rpc:
            return []
        if not ggml_rpc.available():
            raise RpcError(ggml_rpc.NO_RPC)
        # before ggml-rpc opens a socket: its client reads the deadline at each connect
        os.environ[TIMEOUT_ENV] = str(max(1, round(self.timeout_s * 1000)))
        self.probe()   # ggml-rpc aborts the process on a server it cannot reach: check first
        ggml_rpc.exit_on_rpc_abort(self.rpc)
        devices = [d for endpoint in self.rpc for d in ggml_rpc.add_server(endpoint)] + ggml_rpc.local_gpus()
        if len(self.tensor_split) > len(devices):
            raise RpcError(f"--tensor-split has {len(self.tensor_split)} values for {len(devices)} device(s) "
                           f"({', '.join(ggml_rpc.device_name(d) for d in devices)})")
        dev_array = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
        params.devices = ctypes.cast(dev_array, ctypes.c_void_p).value
        keep: list[Any] = [dev_array]
        if self.tensor_split:
            import llama_cpp.llama_cpp as raw

            # llama.cpp copies llama_max_devices() values; devices past the list get 0
            split = (ctypes.c_float * max(raw.llama_max_devices(), len(devices)))(*self.tensor_split)
            params.tensor_split = split
            keep.append(split)
        return keep
