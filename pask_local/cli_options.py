"""Command-line options shared by several subcommands (``--gguf``, ``--model``) and the checks of
the generation options that ``run`` and ``serve`` share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from .errors import PaskError
from .model_registry import MODELS

if TYPE_CHECKING:
    from .rpc.placement import Placement

MODEL_HELP = (f"A named model ({', '.join(MODELS)}; `pask-local models` lists them, "
              "`pask-local models --install NAME` installs one). Not with --gguf.")

ModelOption = Annotated[str | None, typer.Option("--model", help=MODEL_HELP, show_default=False)]
NglOption = Annotated[int, typer.Option("--ngl", help="Model layers offloaded to the GPU (-1: all; needs a CUDA "
                                        "build: scripts/build_llama.py --cuda). 0: CPU only.")]
FlashAttnOption = Annotated[bool, typer.Option("--flash-attn/--no-flash-attn", help="Flash attention (methods "
                                               "that rank by attention scores too: their statistics are computed "
                                               "in the decode graph).")]
HysteresisOption = Annotated[float, typer.Option("--hysteresis", help="A layer over its budget evicts this "
                                                 "fraction of its prompt capacity more at once, so selection runs "
                                                 "every ~F x capacity / (1 - budget) tokens; 0: every token.")]

KvTypeOption = Annotated[str, typer.Option("--kv-type", help="K/V cache element type: f16, q8_0 or q4_0 (quantized: "
                                           "flash attention on).")]
RpcOption = Annotated[str | None, typer.Option("--rpc", help="RPC servers (pask-local rpc-server) as host:port,...: "
                                               "the --ngl offloaded layers, and their K/V, go there "
                                               "(docs/rpc.md).", show_default=False)]
TensorSplitOption = Annotated[str | None, typer.Option("--tensor-split", help="With --rpc: the share of the "
                                                       "offloaded layers each server takes, e.g. 1,1 (default: "
                                                       "by the servers' free memory).", show_default=False)]
RpcTimeoutOption = Annotated[float, typer.Option("--rpc-timeout", help="With --rpc: seconds a server may take to "
                                                 "answer (handshake, each call) before the run ends with an "
                                                 "error.")]
WholePrefillOption = Annotated[bool, typer.Option("--whole-prefill/--no-whole-prefill", help="A method that plans "
                                                  "the prompt (floors-only, pask-prior, kvzip, knorm, ...) prefills "
                                                  "it whole (a prefix it compresses; in `eval`, also each prompt "
                                                  "it runs per query), then drops what the plan does not keep, so "
                                                  "the kept entries' K/V are a full prefill's (memory: the whole "
                                                  "prompt); --no-whole-prefill drops them between chunks, as `run` "
                                                  "does.")]


def make_placement(rpc: str | None, tensor_split: str | None, ngl: int, timeout_s: float) -> Placement | None:
    """``--rpc``/``--tensor-split``/``--ngl`` as an ``rpc.Placement`` (None without --rpc, so --ngl alone
    keeps its meaning), each server's handshake checked; bad values are one PaskError line."""
    from .rpc.endpoints import parse_endpoints, parse_tensor_split
    from .rpc.placement import Placement

    if rpc is None:
        if tensor_split is not None:
            raise PaskError("--tensor-split divides the layers among --rpc servers: add --rpc")
        return None
    placement = Placement(n_layers=ngl, rpc=parse_endpoints(rpc), timeout_s=timeout_s,
                          tensor_split=parse_tensor_split(tensor_split) if tensor_split is not None else ())
    placement.check()
    placement.probe()   # an unreachable server is one line before anything loads or is written
    return placement


def check_device_options(ngl: int, hysteresis: float, kv_type: str = "f16") -> None:
    """``--ngl``, ``--hysteresis`` and ``--kv-type`` (one PaskError line)."""
    from .engine.core import KV_TYPES

    if kv_type not in KV_TYPES:
        raise PaskError(f"unknown --kv-type '{kv_type}' (choose from {', '.join(KV_TYPES)})")
    if ngl < -1:
        raise PaskError(f"--ngl must be -1 (all layers) or >= 0, got {ngl}")
    if not 0.0 <= hysteresis <= 0.5:
        raise PaskError(f"--hysteresis must be in [0, 0.5], got {hysteresis}")


def check_generation_options(method: str, budget: float, max_tokens: int) -> None:
    """``--method``, ``--budget`` and ``--max-tokens`` as ``run`` and ``serve`` take them (one PaskError line)."""
    from .methods import registry

    registry.get(method)  # an unknown name: one line naming the choices
    if not 0.0 < budget <= 1.0:
        raise PaskError(f"--budget must be in (0, 1], got {budget}")
    if max_tokens < 1:
        raise PaskError(f"--max-tokens must be >= 1, got {max_tokens}")
