"""The HTTP connection layer: uvicorn's h11 protocol with a deadline for request headers, and limits.

uvicorn times out idle keep-alive connections but not a client that opens a connection and sends its
headers a byte at a time (slowloris): such connections were held forever. Here a connection whose
request headers are not complete ``header_timeout`` seconds after it started sending them (or
after it connected) is closed, with one log line. The body has its own deadline in the app
(``Server._read_body``); ``limit_concurrency`` bounds connections (uvicorn answers 503 beyond it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("uvicorn.error.pask")


class DeadlineH11Protocol(H11Protocol):
    """h11 with a deadline on each request's headers."""

    header_timeout: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._requests = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the start of another request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers are complete
            self._requests += 1
            self._disarm()

    def _arm(self) -> None:
        self._disarm()
        seen = self._requests
        self._header_timer = self.loop.call_later(self.header_timeout, self._expire, seen)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self, seen: int) -> None:
        self._header_timer = None
        if self._requests != seen or self.transport.is_closing():
            return
        client = self.client[0] if self.client else "?"
        log.warning("client fault from %s: request headers not complete within %.0f s; connection closed",
                    client, self.header_timeout)
        self.transport.close()


def protocol_with_deadline(header_timeout: float) -> type[DeadlineH11Protocol]:
    """A protocol class whose header deadline is ``header_timeout`` seconds."""
    return type("DeadlineH11", (DeadlineH11Protocol,), {"header_timeout": float(header_timeout)})


def uvicorn_config(app: Any, *, log_level: str = "info", header_timeout: float = 10.0,
                   max_connections: int = 64, keep_alive: int = 5) -> Config:
    """uvicorn's config for the app: h11 with the header deadline, the connection limit, keep-alive."""
    return Config(app, log_level=log_level, http=protocol_with_deadline(header_timeout),
                  limit_concurrency=max_connections, timeout_keep_alive=keep_alive, timeout_graceful_shutdown=5)
