"""The ``pask-local`` command line (typer).

Each subcommand is a thin shell over a library function; every ``PaskError`` becomes a one-line
``error: ...`` on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .errors import PaskError

app = typer.Typer(
    name="pask-local",
    help=(
        "Parser-Aware Structural KV persistence for local function calling on llama.cpp.\n\n"
        "Constrained decoding already parses every token; pask-local uses that structure to decide, "
        "per layer group, which tokens' KV entries stay in the cache under a budget."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
err = Console(stderr=True)
out = Console()

GgufOption = Annotated[
    str | None,
    typer.Option("--gguf", help="GGUF model: a local path or hf://owner/repo/file.gguf. "
                 "Default: the embedded Gemma 3 270M (base, Q4_K_M).", show_default=False),
]


@app.command()
def info(gguf: GgufOption = None, load: Annotated[bool, typer.Option(
        "--load/--no-load", help="Also load the model and print its metadata.")] = True) -> None:
    """Show the patched llama.cpp build (patch series hash) and the model that would be used."""
    from . import native
    from .models import resolve_model

    build = native.build_info()
    table = Table(title="pask-local", show_header=False)
    table.add_row("patch series (libllama)", native.patch_version())
    table.add_row("patches applied", ", ".join(build.get("patches", [])))
    table.add_row("build key", build.get("key", "?"))
    path = resolve_model(gguf)
    table.add_row("model", str(path))
    if load:
        from .llm import Model

        m = Model(path)
        table.add_row("architecture", m.arch)
        table.add_row("layers", str(m.n_layer))
        table.add_row("vocab", str(m.n_vocab))
        table.add_row("trained context", str(m.n_ctx_train))
        table.add_row("chat template", "yes" if m.chat_template() else "no (base model: plain format)")
    out.print(table)


def _register_optional_commands() -> None:
    """Subcommands owned by other modules, mounted here so the CLI stays one place to look."""
    from .calibration.cli import calibrate_command
    from .eval.cli import eval_command
    from .run_cli import run_command
    from .tui.cli import tui_command

    app.command("run")(run_command)
    app.command("eval")(eval_command)
    app.command("calibrate")(calibrate_command)
    app.command("tui")(tui_command)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the typer app; PaskError -> one line on stderr, exit 1."""
    _register_optional_commands()
    try:
        app(args=argv)
    except PaskError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
