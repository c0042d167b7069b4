"""Who may drive the server, checked before any route runs.

A server on 127.0.0.1 is still reachable from every web page the user opens: a page may send a
cross-site ``POST`` with ``Content-Type: text/plain`` (no CORS preflight) and, through DNS
rebinding, a name it controls that resolves to 127.0.0.1. So, as llama-server does:

- the ``Host`` header must name an allowed host (the loopback names by default, plus ``--host``
  when it is a specific address, plus each ``--allowed-host``; ``*`` allows any): 403 otherwise;
- a ``POST`` must be ``application/json`` (a browser preflights that, and the server answers no
  CORS): 415 otherwise;
- with ``--api-key``, every route but ``/health`` needs ``Authorization: Bearer KEY``: 401 otherwise.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
PUBLIC_PATHS = frozenset({"/health"})  # a liveness probe needs no key (as llama-server's /health)
log = logging.getLogger("uvicorn.error.pask")


def host_name(header: str) -> str:
    """The host of a ``Host`` header, lower-case, without port or IPv6 brackets ('' if malformed)."""
    h = header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        return h[1:end] if end > 0 else ""
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def is_wildcard(host: str) -> bool:
    """``host`` binds every interface (0.0.0.0, ::, '')."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host == ""


@dataclass(frozen=True)
class Guard:
    """The allowed Host names and the optional API key."""

    allowed_hosts: frozenset[str] = LOOPBACK_HOSTS
    api_key: str | None = None

    @classmethod
    def for_server(cls, bind_host: str, extra_hosts: Iterable[str] = (), api_key: str | None = None) -> Guard:
        hosts = set(LOOPBACK_HOSTS) | {host_name(h) for h in extra_hosts if h.strip()}
        if not is_wildcard(bind_host):
            hosts.add(host_name(bind_host))
        return cls(frozenset(hosts), api_key or None)

    def refuse(self, method: str, path: str, headers: Headers) -> tuple[int, str, str, dict[str, str]] | None:
        """(status, message, code, headers) when the request may not pass, else None."""
        if "*" not in self.allowed_hosts:
            host = host_name(headers.get("host", ""))
            if host not in self.allowed_hosts:
                return (403, f"the Host header {headers.get('host', '')[:100]!r} is not allowed (this server "
                        f"answers {', '.join(sorted(self.allowed_hosts))}; start it with --allowed-host NAME "
                        f"to add one)", "host_not_allowed", {})
        if self.api_key is not None and path not in PUBLIC_PATHS:
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                return (401, "a valid API key is required (Authorization: Bearer KEY)", "invalid_api_key",
                        {"WWW-Authenticate": "Bearer"})
        if method == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return (415, f"the request body must be application/json, got {media or 'no Content-Type'!r}",
                        "unsupported_media_type", {})
        return None


class GuardMiddleware:
    """Pure ASGI middleware applying a ``Guard`` to every HTTP request."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.guard.refuse(scope["method"], scope["path"], Headers(scope=scope))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message, code, extra = refusal
        client = scope.get("client") or ("?", 0)
        log.warning("client fault from %s: %d %s %s: %s", client[0], status, scope["method"], scope["path"], code)
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}, ensure_ascii=True).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
