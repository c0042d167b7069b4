"""`pask-local tui`: open a trace (or two, to compare) in the viewer, or run a request live into it.

``tui_command`` is the typer command (mounted by pask_local/cli.py); ``run_tui`` is the library
entry point that ``pask-local run --tui`` can call with a job that writes a trace.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from pask_local.errors import PaskError

from .trace import load_trace


def tui_command(
    trace: Annotated[Path, typer.Argument(help="A trace written by `pask-local run --trace FILE` (with "
                                          "--live: the file to write).", show_default=False)],
    compare: Annotated[Path | None, typer.Option("--compare", help="A second trace to show side by side "
                                                 "(e.g. a baseline on the same request).",
                                                 show_default=False)] = None,
    live: Annotated[bool, typer.Option("--live", help="Run --request now, write TRACE and watch it "
                                       "being written.")] = False,
    request: Annotated[str | None, typer.Option("--request", help="With --live: what the user asks for.",
                                                show_default=False)] = None,
    schema: Annotated[Path | None, typer.Option("--schema", help="With --live: tool definitions (JSON file).",
                                                show_default=False)] = None,
    method: Annotated[str, typer.Option("--method", help="With --live: KV persistence method.")] = "pask",
    budget: Annotated[float, typer.Option("--budget", help="With --live: fraction of full KV kept.")] = 0.33,
    gguf: Annotated[str | None, typer.Option("--gguf", help="With --live: GGUF model (default: the "
                                             "embedded Gemma 3 270M).", show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="With --live: generation limit.")] = 256,
) -> None:
    """Show which tokens' KV entries persist in which layer group, step by step.

    Example: pask-local run --schema examples/get_weather.json --trace t.jsonl "Weather in Paris?"
    then pask-local tui t.jsonl  (press ? inside for the keys).
    """
    compare_trace = load_trace(compare) if compare is not None else None
    if not live:
        if request is not None or schema is not None:
            raise PaskError("--request/--schema are for --live; to view a finished trace give only TRACE")
        traces = [load_trace(trace)] + ([compare_trace] if compare_trace else [])
        from .app import TraceApp

        TraceApp.from_traces(traces).run()
        return
    if not request or schema is None:
        raise PaskError("--live needs --request TEXT and --schema FILE")
    run_tui(engine_job(request, schema, method, budget, gguf, max_tokens), trace,
            compare=[compare_trace] if compare_trace else [])


def engine_job(request: str, schema: Path, method: str, budget: float, gguf: str | None,
               max_tokens: int, parallel: bool = False) -> Callable[[Path], Any]:
    """A job for ``run_tui``: one engine run of ``request`` writing its trace to the given path."""
    if not 0.0 < budget <= 1.0:
        raise PaskError(f"--budget must be in (0, 1], got {budget}")
    if not schema.is_file():
        raise PaskError(f"schema file not found: {schema}")
    from pask_local.engine import Engine, EngineConfig, make_method
    from pask_local.llm import Model
    from pask_local.models import resolve_model
    from pask_local.schema.tools import read_tools

    tools = read_tools(schema)
    model = Model(resolve_model(gguf))
    engine = Engine(model, make_method(method, model, None), EngineConfig(budget=budget, max_tokens=max_tokens))

    def job(path: Path) -> Any:
        return engine.run(tools, request, parallel=parallel, trace=path)

    return job


def run_tui(job: Callable[[Path], Any], trace: Path | None = None, compare: list | None = None) -> Any:
    """Start ``job(trace_path)`` in a thread and show its trace live; returns the job's result.

    ``trace``: where the trace goes (default: a temporary file removed afterwards). ``compare``:
    finished traces shown next to it.
    """
    from .app import TraceApp
    from .live import start_run
    from .replay import Replay

    tmp = None
    if trace is None:
        tmp = tempfile.TemporaryDirectory(prefix="pask-tui-")
        trace = Path(tmp.name) / "live.jsonl"
    try:
        feed = start_run(job, trace)
        assert feed.replay is not None
        app = TraceApp([feed.replay, *[Replay(t) for t in (compare or [])]], feeds=[feed], on_exit=feed.close)
        app.run()
        worker = feed.worker
        if worker is not None:
            worker.join()
            if worker.failure:
                raise PaskError(worker.failure)
            return worker.result
        return None
    finally:
        if tmp is not None:
            tmp.cleanup()
