"""``--no-batch``: every request in its own llama context, ``slots`` of them at once.

The same interface as ``SlotPool`` (``submit`` -> future, ``busy``/``waiting``, ``stats``, ``close``)
and the same queue (``request_queue``: the 429 bound, arrival order), so the server has one path.
What differs is the run: ``Engine.execute`` allocates a context sized for the request alone (any
prompt up to the model's context, the method's own peak, bit for bit what ``pask-local run`` does)
and runs the request to its end; it cannot be interleaved with others in one loop, so each slot is a
thread that takes the next request from the queue and executes it. A request's cancel flag stops it
at its next token (its prompt is read to the end first), or before it starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .core import Engine, EngineResult, Prepared, TokenHook
from .request_queue import PoolClosed, RequestCancelled, RequestQueue


@dataclass
class _Request:
    engine: Engine
    prepared: Prepared
    on_token: TokenHook | None
    cancelled: Callable[[], bool]
    trace: str | Path | None = None
    future: Future[EngineResult] = field(default_factory=Future)


class IsolatedPool:
    """``slots`` threads, each running one request at a time in a context of its own (module doc)."""

    def __init__(self, slots: int = 1, queue_size: int | None = None) -> None:
        self.queue: RequestQueue[_Request] = RequestQueue(slots, queue_size)
        self.slots = slots
        self._closing = threading.Event()  # running requests stop at their next token
        self._threads = [threading.Thread(target=self._loop, name=f"pask-slot-{i}", daemon=True)
                         for i in range(slots)]
        for t in self._threads:
            t.start()

    @property
    def busy(self) -> int:
        """Slots running a request now."""
        return self.queue.running

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self.queue.waiting)

    def check(self, engine: Engine, prepared: Prepared) -> None:
        """Any prepared request runs here (``Engine.prepare`` sized its own context)."""

    def submit(self, engine: Engine, prepared: Prepared, on_token: TokenHook | None = None,
               cancelled: Callable[[], bool] = lambda: False, trace: str | Path | None = None) -> Future[EngineResult]:
        """Queue a prepared request (``QueueFull``, ``PoolClosed`` as ``SlotPool.submit``); its future
        holds the result or the error."""
        req = _Request(engine, prepared, on_token, cancelled, trace)
        self.queue.put(req)
        return req.future

    def stats(self) -> dict[str, Any]:
        return {"slots": self.slots, "busy": self.busy, "waiting": self.waiting}

    def close(self, timeout: float = 5.0) -> None:
        """Fail what waits, stop what runs at its next token, and join the slot threads."""
        self._closing.set()
        for req in self.queue.close():
            req.future.set_exception(PoolClosed("the server is shutting down"))
        for t in self._threads:
            t.join(timeout)

    def _loop(self) -> None:
        q = self.queue
        while True:
            with q.cond:
                while not q.waiting and not q.closed:
                    q.cond.wait()
                if q.closed:
                    return
                req = q.waiting.popleft()
                q.running += 1
            try:
                self._run(req)
            finally:
                with q.cond:
                    q.running -= 1

    def _run(self, req: _Request) -> None:
        if req.cancelled():
            req.future.set_exception(RequestCancelled("the request was cancelled before it started"))
            return
        hook = req.on_token

        def on_token(token: int) -> bool:
            stop = bool(hook(token)) if hook is not None else False
            return stop or req.cancelled() or self._closing.is_set()

        try:
            req.future.set_result(req.engine.execute(req.prepared, trace=req.trace, on_token=on_token))
        except BaseException as exc:  # delivered to whoever awaits the request
            req.future.set_exception(exc)
