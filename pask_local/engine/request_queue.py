"""The one queue in front of a pool's slots: arrival order, the 429 bound, shutdown.

``put`` admits a request only while running + waiting < slots + ``queue_size`` (None: no bound);
otherwise it raises ``QueueFull`` at once (the server answers 429). The pool that owns the queue
takes requests from it in arrival order and counts what it runs; ``close`` hands back what still
waits, for the pool to fail.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

from ..errors import PaskError

T = TypeVar("T")


class QueueFull(PaskError):
    """No slot is free and the queue holds as many waiting requests as it may."""


class PoolClosed(PaskError):
    """The pool is shutting down."""


class RequestCancelled(PaskError):
    """The request was cancelled before its first token (``started``: it held a slot)."""

    def __init__(self, message: str, started: bool = False) -> None:
        super().__init__(message)
        self.started = started


class RequestQueue(Generic[T]):
    """A FIFO of waiting requests bounded together with the running ones (module doc).

    ``cond`` guards ``waiting`` and ``running``; the owner holds it while it moves requests between them."""

    def __init__(self, slots: int, queue_size: int | None = None) -> None:
        if slots < 1:
            raise PaskError(f"a pool needs at least one slot, got {slots}")
        if queue_size is not None and queue_size < 0:
            raise PaskError(f"the queue size must be >= 0, got {queue_size}")
        self.slots = slots
        self.queue_size = queue_size
        self.cond = threading.Condition()
        self.waiting: deque[T] = deque()
        self.running = 0
        self.closed = False

    def put(self, item: T) -> None:
        """Queue ``item``, or raise ``QueueFull`` / ``PoolClosed`` (never blocks)."""
        with self.cond:
            if self.closed:
                raise PoolClosed("the pool is shutting down")
            if self.queue_size is not None and self.running + len(self.waiting) >= self.slots + self.queue_size:
                raise QueueFull(f"the request queue is full ({self.running} running, {len(self.waiting)} waiting)")
            self.waiting.append(item)
            self.cond.notify_all()

    def put_back(self, items: Iterable[T]) -> None:
        """Requests taken but not started go back to the head, in their order (caller holds ``cond``)."""
        self.waiting.extendleft(reversed(list(items)))

    def close(self) -> list[T]:
        """Take no more requests; what still waits is returned (to be failed by the owner)."""
        with self.cond:
            self.closed = True
            left = list(self.waiting)
            self.waiting.clear()
            self.cond.notify_all()
        return left
