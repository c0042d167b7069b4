"""Live view: run a request in a background thread and tail its trace file into the app.

``FileFeed`` reads whatever complete lines the engine has written so far (it validates them with
the same ``TraceReader`` as a finished file); ``start_run`` starts the engine thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pask_local.errors import PaskError

from .replay import Replay
from .trace import TraceError, TraceReader


class FileFeed:
    """Tails a trace file that another thread (or process) is writing."""

    def __init__(self, path: Path, worker: threading.Thread | None = None) -> None:
        self.path = Path(path)
        self.reader = TraceReader(str(self.path))
        self.worker = worker
        self.error: str | None = None
        self._buf = ""
        self._fh = None
        self.replay: Replay | None = None

    def poll(self) -> bool:
        """Read new complete lines; True when at least one arrived."""
        if self.error is not None:
            return False
        if self._fh is None:
            if not self.path.exists():
                return False
            self._fh = open(self.path, encoding="utf-8")  # noqa: SIM115 (kept open while tailing)
        chunk = self._fh.read()
        if not chunk:
            return False
        self._buf += chunk
        *lines, self._buf = self._buf.split("\n")
        try:
            for line in lines:
                self.reader.feed_line(line)
        except TraceError as exc:
            self.error = str(exc)
            return False
        if self.replay is None and self.reader.trace is not None:
            self.replay = Replay(self.reader.trace)
        return bool(lines)

    @property
    def done(self) -> bool:
        if self.failure is not None:
            return True
        t = self.reader.trace
        return t is not None and t.final is not None

    @property
    def failure(self) -> str | None:
        """Why the live trace stopped early (a bad line, or the run's error)."""
        if self.error is not None:
            return self.error
        return self.worker.failure if isinstance(self.worker, RunThread) else None

    def wait_for_header(self, timeout: float = 600.0) -> Replay:
        """Block until the header line arrived (or the run failed)."""
        t0 = time.monotonic()
        while self.replay is None:
            self.poll()
            if self.error:
                raise TraceError(self.error)
            if self.worker is not None and not self.worker.is_alive() and self.replay is None:
                self.poll()
                if self.replay is None:
                    raise PaskError(getattr(self.worker, "failure", None) or "the run ended before writing a trace")
            if time.monotonic() - t0 > timeout:
                raise PaskError(f"no trace header after {timeout:.0f} s")
            time.sleep(0.05)
        return self.replay

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class RunThread(threading.Thread):
    """Runs ``job(trace_path)`` (e.g. an engine run); keeps its error message as ``failure``."""

    def __init__(self, job: Callable[[Path], Any], trace_path: Path) -> None:
        super().__init__(daemon=True, name="pask-live-run")
        self.job = job
        self.trace_path = trace_path
        self.failure: str | None = None
        self.result: Any = None

    def run(self) -> None:
        try:
            self.result = self.job(self.trace_path)
        except PaskError as exc:
            self.failure = str(exc)
        except Exception as exc:  # noqa: BLE001 (shown to the user in the view, not swallowed)
            self.failure = f"{type(exc).__name__}: {exc}"


def start_run(job: Callable[[Path], Any], trace_path: Path) -> FileFeed:
    """Start ``job`` writing ``trace_path`` and return a feed on it (header already read)."""
    trace_path = Path(trace_path)
    if trace_path.exists():
        trace_path.unlink()
    worker = RunThread(job, trace_path)
    worker.start()
    feed = FileFeed(trace_path, worker)
    feed.wait_for_header()
    return feed
