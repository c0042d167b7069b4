"""Admission and execution: a bounded FIFO queue in front of N worker slots, with cancellation.

Each slot is a thread that runs one job at a time (one engine request, its own llama context).
``submit`` admits a job only while running + waiting < slots + queue size; otherwise it raises
``QueueFull`` at once (the server answers 429). ``Job.cancel`` marks a job: a queued job is skipped
when a slot picks it up, a running one is expected to poll ``Job.cancelled`` (the engine's
``on_token`` hook does) and return early; either way the slot is free again.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class QueueFull(Exception):
    """No slot is free and the queue holds as many waiting jobs as it may."""


class Cancelled(Exception):
    """The job was cancelled before a slot started it."""


class Job:
    """One unit of work: ``fn(job)`` runs on a slot thread; its outcome lands in ``future``."""

    def __init__(self, fn: Callable[[Job], Any]) -> None:
        self.fn = fn
        self.future: Future[Any] = Future()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        """Ask the job to stop (idempotent; a finished job is unaffected)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


class Scheduler:
    """``slots`` worker threads fed from a FIFO of at most ``queue_size`` waiting jobs."""

    def __init__(self, slots: int = 1, queue_size: int = 8) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        if queue_size < 0:
            raise ValueError("queue_size must be >= 0")
        self.slots = slots
        self.queue_size = queue_size
        self._waiting: deque[Job] = deque()
        self._running: set[Job] = set()
        self._closed = False
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._worker, name=f"pask-slot-{i}", daemon=True)
                         for i in range(slots)]
        for t in self._threads:
            t.start()

    @property
    def busy(self) -> int:
        """Slots running a job now."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Jobs admitted but not started."""
        return len(self._waiting)

    def submit(self, fn: Callable[[Job], Any]) -> Job:
        """Admit ``fn`` as a job, or raise ``QueueFull`` (never blocks)."""
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down")
            if len(self._running) + len(self._waiting) >= self.slots + self.queue_size:
                raise QueueFull(f"the request queue is full ({len(self._running)} running, "
                                f"{len(self._waiting)} waiting)")
            job = Job(fn)
            self._waiting.append(job)
            self._cond.notify()
            return job

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._waiting.popleft()
                self._running.add(job)
            try:
                if job.cancelled:
                    job.future.set_exception(Cancelled())
                    continue
                try:
                    job.future.set_result(job.fn(job))
                except BaseException as exc:  # delivered to whoever awaits the job
                    job.future.set_exception(exc)
            finally:
                with self._cond:
                    self._running.discard(job)

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking jobs, cancel the queued and running ones, and join the slot threads."""
        with self._cond:
            self._closed = True
            for job in self._waiting:
                job.cancel()
                job.future.set_exception(Cancelled())
            self._waiting.clear()
            for job in self._running:
                job.cancel()
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
