"""Command-line options shared by several subcommands (``--gguf``, ``--model``) and the checks of
the generation options that ``run`` and ``serve`` share."""

from __future__ import annotations

from typing import Annotated

import typer

from .errors import PaskError
from .model_registry import MODELS

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
