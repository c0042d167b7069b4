"""Command-line options shared by several subcommands (``--gguf``, ``--model``)."""

from __future__ import annotations

from typing import Annotated

import typer

from .model_registry import MODELS

MODEL_HELP = (f"A named model ({', '.join(MODELS)}; `pask-local models` lists them, "
              "`pask-local models --install NAME` installs one). Not with --gguf.")

ModelOption = Annotated[str | None, typer.Option("--model", help=MODEL_HELP, show_default=False)]
