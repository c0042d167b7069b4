"""The ``pask-local study`` sub-app: the method study's commands (run, table, compare, headroom,
kv-bytes), mounted by ``pask_local/cli.py`` with ``app.add_typer(study_app, name="study")``.

Each command is a thin shell over its module here (which reuses ``pask_local.eval``); bad input is a
``PaskError`` (an unreadable or unwritable file too), which the ``pask-local`` entry point prints as
one ``error: ...`` line with exit status 1. Tables go to stdout as markdown, progress to stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from ..errors import PaskError

study_app = typer.Typer(
    name="study",
    help=(
        "The method study: many [bold]pask-local eval[/] runs (method x budget) merged into one table "
        "on the cases every run holds, with paired sign tests against the best baseline.\n\n"
        "[bold]run[/] runs the whole study in one-thread jobs (resumable) and writes the table; "
        "[bold]table[/] merges eval output directories; [bold]compare[/] pairs two runs case by case; "
        "[bold]headroom[/] splits the cases by whether Full KV's answer fits each budget; "
        "[bold]kv-bytes[/] prices studies' K/V caches against Full KV at f16."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

T = TypeVar("T")
GgufOption = Annotated[str | None, typer.Option("--gguf", help="A GGUF path.", show_default=False)]


RUN_HELP = (
    "Run the whole method study in one-thread [bold]pask-local eval[/] jobs, resumable, then "
    "merge one table.\n\n"
    "Jobs: one for the methods that prefill the whole prompt before compressing (SnapKV, "
    "PyramidKV, pask-hybrid, pask-attn share one prefill per case at every budget), one per other "
    "(method, budget), Full KV included. Each job has its own directory OUT/JOB; rerunning the "
    "same command resumes, a larger --limit adds cases. The records are merged on the cases every "
    "run holds into OUT/study.json, OUT/study.md (also printed) and OUT/study.png."
)

TABLE_HELP = (
    "The method study's table from one or more [bold]pask-local eval[/] output directories.\n\n"
    "The directories are merged and only the cases every run holds are kept, so each row is "
    "measured on the same cases. Per budget: accuracy, retention, agreement with Full KV, wall "
    "seconds, the best baseline, and every PASK variant paired against it (wins/losses, exact "
    "sign test). Prints the markdown table."
)

COMPARE_HELP = (
    "Paired comparison of run A with other runs, on the cases both ran (exact sign test).\n\n"
    "Per pair: the cases, both accuracies, how many cases A gets right and B wrong and the "
    'reverse, the exact two-sided sign test (McNemar) p-value for "A and B are equally accurate", '
    "and how often A's output is character-for-character B's. A markdown table on stdout."
)

HEADROOM_HELP = (
    "Split a method study's cases by whether Full KV's answer fits each budget.\n\n"
    "Reads the study's job directories (every subdirectory with a run.json), keeps the cases "
    "every run holds, tokenizes Full KV's outputs with the model, and writes STUDY/headroom.json "
    "and STUDY/headroom.md (also printed)."
)

KV_BYTES_HELP = (
    "K/V bytes and accuracy of method studies against Full KV at f16, for the same requests.\n\n"
    "The studies must differ in their K/V element type only (one study per type; each is merged "
    "on its own); the cases are those every run of every study holds. Full KV's f16 bytes for a "
    "request are measured by creating the context with llama.cpp (one per distinct size), not "
    "computed from the model's shape. The model is the studies' GGUF (checked by its size) unless "
    "--model or --gguf names it. Writes OUT.json and OUT.md (also printed)."
)


@contextmanager
def _files() -> Iterator[None]:
    """A file that cannot be read or written is one ``error:`` line, as any other bad input."""
    try:
        yield
    except OSError as exc:
        raise PaskError(str(exc)) from None


def _call(fn: Callable[..., T], *args, **kwargs) -> T:
    with _files():
        return fn(*args, **kwargs)


@study_app.command("run", help=RUN_HELP, epilog=(
    "Example (two workers; the eval options after --):\n\n"
    "pask-local study run --model qwen2.5-coder-1.5b --limit 5 --jobs 2 "
    "--methods full,streaming,h2o,snapkv,pyramidkv,tova,pask-prior,pask-hybrid --budgets 0.33,0.2,0.1 "
    "--out results/study -- --max-tokens 128"))
def run_command(
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated methods (pask-local methods).",
                                         show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="The study's directory: one eval output directory per job "
                                      "(reused to resume), study.json, study.md, study.png.",
                                      show_default=False)],
    model: Annotated[str | None, typer.Option("--model", help="A named model (pask-local models).",
                                              show_default=False)] = None,
    gguf: GgufOption = None,
    budgets: Annotated[str, typer.Option("--budgets", help="Comma-separated KV budgets in (0, 1].")] = "0.33",
    limit: Annotated[int | None, typer.Option("--limit", help="Cases per category (first N of the split).",
                                              show_default=False)] = None,
    split: Annotated[str, typer.Option("--split", help="eval, calib or all.")] = "eval",
    categories: Annotated[str | None, typer.Option("--categories", help="Comma-separated BFCL categories "
                                                   "(default: all).", show_default=False)] = None,
    jobs: Annotated[int, typer.Option("--jobs", help="Worker processes, one thread each.")] = 2,
    extra: Annotated[list[str] | None, typer.Argument(
        help="After --: more pask-local eval options, e.g. -- --max-tokens 128 (--fidelity: every run a job "
             "of its own, all sharing Full KV's references in OUT/fidelity_ref).", show_default=False)] = None,
) -> None:
    """Run the whole method study in one-thread [bold]pask-local eval[/] jobs, resumable, then merge one table."""
    from .run import run_study

    try:
        table, failed = _call(run_study, model, gguf, methods, budgets, limit, split, categories, jobs, out,
                              list(extra or []))
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        raise typer.Exit(130) from None
    print(table, end="")
    if failed:
        print(f"error: job(s) {', '.join(failed)} failed (their log.txt says why); rerun to resume", file=sys.stderr)
        raise typer.Exit(1)


@study_app.command("table", help=TABLE_HELP, epilog=(
    "Example: pask-local study table results/table-a results/table-b --json docs/table.json "
    "--md docs/table.md --png docs/table.png --runs full,snapkv@0.2"))
def table_command(
    dirs: Annotated[list[Path], typer.Argument(help="pask-local eval --out directories (same settings).",
                                               show_default=False)],
    runs: Annotated[str | None, typer.Option("--runs", help="Comma list of runs to keep, e.g. full,snapkv@0.2 "
                                             "(default: every run found).", show_default=False)] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the study as JSON.",
                                                   show_default=False)] = None,
    md: Annotated[Path | None, typer.Option("--md", help="Write the markdown table.", show_default=False)] = None,
    png: Annotated[Path | None, typer.Option("--png", help="Write the plot.", show_default=False)] = None,
) -> None:
    """The method study's table from one or more [bold]pask-local eval[/] output directories."""
    from .table import study_table

    print(_call(study_table, dirs, runs, json_path, md, png), end="")


@study_app.command("compare", help=COMPARE_HELP, epilog=(
    "Examples: pask-local study compare results/eval50 pask@0.33 snapkv@0.33 full; "
    "pask-local study compare results/qwen-native full full --b-out results/qwen-plain"))
def compare_command(
    out: Annotated[Path, typer.Argument(help="A pask-local eval output directory.", show_default=False)],
    a: Annotated[str, typer.Argument(help="Run A, e.g. pask@0.33.", show_default=False)],
    others: Annotated[list[str], typer.Argument(help="Runs to compare A with, e.g. snapkv@0.33 full.",
                                                show_default=False)],
    b_out: Annotated[Path | None, typer.Option("--b-out", help="Read the compared runs from this directory "
                                               "(cases still paired by id).", show_default=False)] = None,
) -> None:
    """Paired comparison of run A with other runs, on the cases both ran (exact sign test)."""
    from .compare import compare

    _call(compare, out, a, others, b_out, emit=print)


@study_app.command("headroom", help=HEADROOM_HELP, epilog="Example: pask-local study headroom --model qwen2.5-coder-1.5b "
                   "docs/runs/qwen15-study")
def headroom_command(
    study: Annotated[Path, typer.Argument(help="A pask-local study run --out directory.", show_default=False)],
    model: Annotated[str | None, typer.Option("--model", help="A named model (pask-local models).",
                                              show_default=False)] = None,
    gguf: Annotated[str | None, typer.Option("--gguf", help="A GGUF path (the study's model).",
                                             show_default=False)] = None,
) -> None:
    """Split a method study's cases by whether Full KV's answer fits each budget."""
    from .headroom import study_headroom

    print(_call(study_headroom, study, model, gguf), end="")


@study_app.command("kv-bytes", help=KV_BYTES_HELP, epilog="Example: pask-local study kv-bytes docs/runs/qwen15-study "
                   "docs/runs/qwen15-q8 --out docs/runs/qwen15-q8/kv_bytes")
def kv_bytes_command(
    studies: Annotated[list[Path], typer.Argument(help="pask-local study run --out directories, one per K/V "
                                                  "type.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Write OUT.json and OUT.md.", show_default=False)],
    model: Annotated[str | None, typer.Option("--model", help="A named model (default: the studies' own GGUF).",
                                              show_default=False)] = None,
    gguf: Annotated[str | None, typer.Option("--gguf", help="A GGUF path (default: the studies' own GGUF).",
                                             show_default=False)] = None,
) -> None:
    """K/V bytes and accuracy of method studies against Full KV at f16, for the same requests."""
    from .kv_bytes import study_kv_bytes

    print(_call(study_kv_bytes, studies, out, model, gguf), end="")
