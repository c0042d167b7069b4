"""The HTTP routes (Starlette): chat completions, models, health, metrics.

``Server`` holds what every request shares: the model (loaded once), the pool and the metrics.
``POST /v1/chat/completions`` validates the body (``openai_io``), plans and sizes the request on a
thread (``Engine.prepare``: a prompt that does not fit is a 400 before any KV is allocated), then
submits it to the pool and awaits its future: ``engine.pool.SlotPool`` (continuous batching, the
default) or ``engine.isolated_pool.IsolatedPool`` (``--no-batch``). The pool owns the queue (429
when it is full), the slots and shutdown. The request's ``on_token`` hook feeds the stream; its
cancel flag, set when the client disconnects (stream or not), stops it at the pool's next step and
frees its slot. Errors are OpenAI's error object with the matching status; a bad request is never a 500.

Before any of that, work is bounded: the body must arrive within ``body_timeout`` seconds (408), and
a body over 1 MiB is parsed, rendered and tokenized with at most ``prepare_workers - 1`` others, at
most ``queue_size`` more waiting (429 beyond), so a flood of large bodies does not hold up usual ones. A body whose messages hold more text than the context can
take (the vocabulary's longest token times the context) is refused before it is rendered or
tokenized. Each client fault is one log line; ``guard`` checks Host, Content-Type and the API key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..engine import Engine, EngineConfig, EngineResult, make_method
from ..engine.core import Prepared
from ..engine.factory import DEFAULT_POLICY_METHODS
from ..engine.isolated_pool import IsolatedPool
from ..engine.pool import PoolClosed, PoolLayout, QueueFull, RequestCancelled, SlotPool
from ..errors import ContextLengthError, PaskError
from ..llm import Model
from ..methods import Method
from ..policy import Policy
from ..policy.shipped import resolve_default_policy
from .guard import Guard, GuardMiddleware
from .metrics import Metrics
from .openai_io import (
    APIError,
    ChatRequest,
    Defaults,
    bad_request,
    chunk_body,
    completion_body,
    completion_id,
    error_body,
    models_body,
    now,
    parse_chat_request,
    parse_json_body,
    pask_stats,
    usage,
    usage_chunk,
)
from .prefix_dir import PrefixDir
from .streaming import SSE_DONE, SSE_KEEPALIVE, ReplyStreamer, sse

KEEPALIVE_S = 5.0        # an SSE comment while a stream waits for its slot
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
GATED_BODY_BYTES = 1 << 20  # bodies larger than this are parsed and prepared ``prepare_workers`` at a time
log = logging.getLogger("uvicorn.error.pask")


@dataclass
class ServerConfig:
    model_id: str
    defaults: Defaults = field(default_factory=Defaults)
    slots: int = 1
    queue_size: int = 8
    max_context: int = 0              # prompt + max_tokens per request; 0: the model's trained context
    max_body_bytes: int = 16 << 20
    flash_attn: bool = EngineConfig.flash_attn  # EngineConfig.flash_attn of every request
    hysteresis: float = EngineConfig.hysteresis  # EngineConfig.hysteresis of every request
    batch: bool = True                # continuous batching in one persistent context (engine.pool)
    kv_mem: int = 0                   # batch: K/V bytes the slots may take (0: ``slots`` slots)
    slot_len: int = 0                 # batch: prompt + max_tokens per slot (0: max_context, else 4096)
    prefill_tokens: int = 128         # batch: prompt tokens one step may carry (0: a chunk per prefilling slot)
    prefix_cache: bool = True         # batch: a new request reuses a free slot's KV of the same prompt prefix
    reuse_compressed: bool = False    # batch: also reuse prefixes a method compressed under another request
    body_timeout: float = 30.0        # seconds a request body may take to arrive (408 after)
    prepare_workers: int = 2          # requests parsed, rendered and tokenized at once
    guard: Guard = field(default_factory=Guard)
    kv_type: str = EngineConfig.kv_type  # K/V element type of every request (and of the pool)
    prefixes: tuple[Path, ...] = ()   # batch: prefix files (``pask-local compress``) every matching request starts from
    prefix_dir: Path | None = None    # batch: prefix files kept across restarts (``server.prefix_dir``)


DEFAULT_SLOT_LEN = 4096


def finish_reason(result: EngineResult) -> str:
    if result.message.tool_calls:
        return "tool_calls"
    return "length" if result.finish == "length" else "stop"


def model_failure(result: EngineResult) -> APIError | None:
    """A reply the model got wrong (not a length cut-off): a server error, never the client's fault."""
    if result.error is None or result.finish == "length":
        return None
    return APIError(500, f"the model's output is not a valid call: {result.error}", type="server_error",
                    code="invalid_model_output")


class Server:
    """The loaded model, the pool and the metrics shared by all requests."""

    def __init__(self, model: Model, config: ServerConfig) -> None:
        self.model = model
        self.cfg = config
        self.created = now()
        self._policy: Policy | None = None
        self.warnings: list[str] = []
        method = self.method(config.defaults.method)  # the default method must build: a bad policy fails here
        self.pool: SlotPool | IsolatedPool
        if config.batch:
            layout = self.pool_layout(method)
            self.pool = SlotPool(model, layout, flash_attn=config.flash_attn, prefill_tokens=config.prefill_tokens,
                                 prefix_cache=config.prefix_cache,
                                 reuse="any" if config.reuse_compressed else "exact", queue_size=config.queue_size)
            self.slots = layout.slots
            self.context_limit = layout.slot_len
        else:
            self.slots = max(1, config.slots)  # auto: one context at a time
            self.pool = IsolatedPool(self.slots, config.queue_size)
            self.context_limit = config.max_context or model.n_ctx_train
        self.batched = isinstance(self.pool, SlotPool)
        self.prefix_dir: PrefixDir | None = None
        try:
            if config.prefixes:
                self._pin_prefixes(method, config.prefixes)
            if config.prefix_dir is not None:
                if not isinstance(self.pool, SlotPool):
                    raise PaskError("--prefix-dir needs the batched pool (drop --no-batch)")
                self.prefix_dir = PrefixDir(config.prefix_dir, model, self.pool, config.kv_type, self.context_limit,
                                            self._warn_later)
                self.prefix_dir.load()
        except BaseException:
            self.pool.close()
            raise
        self.gate = PrepareGate(config.prepare_workers, config.queue_size)
        # a prompt of B bytes is at least B / longest-piece tokens: text past this cannot fit
        self.max_message_chars = self.context_limit * model.longest_piece()
        pool = self.pool
        self.metrics = Metrics(lambda: pool.busy, lambda: pool.waiting, self.slots, config.queue_size,
                               pool if isinstance(pool, SlotPool) else None)

    def _warn_later(self, line: str) -> None:
        """A warning at start (printed by the CLI) or while serving (logged)."""
        self.warnings.append(line)
        if hasattr(self, "metrics"):
            log.warning(line)

    def _pin_prefixes(self, method: Method, paths: tuple[Path, ...]) -> None:
        """Load each prefix file once (checked against the model, the default method, budget and K/V
        type); the pool restores it into every request whose prompt starts with it."""
        from ..prefix.build import open_file, pin

        if not isinstance(self.pool, SlotPool):
            raise PaskError("--prefix needs the batched pool (drop --no-batch)")
        budget = None if method.keeps_all else self.cfg.defaults.budget
        for path in paths:
            header, blob = open_file(path, self.model)
            if header.n_prefix >= self.context_limit:
                raise PaskError(f"prefix file {path.name} holds {header.n_prefix} tokens; a slot holds "
                                f"{self.context_limit} (raise --max-context)")
            self.pool.pin(pin(path, header, blob, self.model, method.name, budget, self.cfg.kv_type))

    def pool_layout(self, method: Method) -> PoolLayout:
        """The slots of the batched pool: ``kv_mem`` bytes of K/V or ``slots`` slots of ``slot_len`` tokens."""
        cfg = self.cfg
        slot_len = cfg.slot_len or cfg.max_context or min(DEFAULT_SLOT_LEN, self.model.n_ctx_train)
        slot_len = min(slot_len, self.model.n_ctx_train)
        kv_mem = cfg.kv_mem or None
        if not cfg.slots and kv_mem is None:  # auto: the K/V memory one Full KV slot would take
            kv_mem = SlotPool.slot_kv_bytes(self.model, make_method("full", self.model), 1.0, slot_len, cfg.kv_type)
        return SlotPool.layout_for(self.model, method, cfg.defaults.budget, slot_len,
                                   slots=None if kv_mem else cfg.slots, kv_mem=kv_mem, kv_type=cfg.kv_type)

    # ------------------------------------------------------------ engine
    def method(self, name: str) -> Method:
        """The method ``name``, built once and shared by every request (a request's state lives in its
        run's plan, ``Method.bind``); the model's default policy resolved once for every name that runs it."""
        # kept in __dict__ so that only this function knows of the cache; a race builds an equal
        # object twice, and setdefault keeps one of them
        cache: dict[str, Method] = self.__dict__.setdefault("_methods", {})
        method = cache.get(name)
        if method is not None:
            return method
        if name in DEFAULT_POLICY_METHODS:
            if self._policy is None:
                self._policy, warning = resolve_default_policy(self.model)
                if warning:
                    self.warnings.append(warning)
            method = make_method(name, self.model, self._policy)
        else:
            method = make_method(name, self.model)
        return cache.setdefault(name, method)

    def engine(self, req: ChatRequest) -> Engine:
        try:
            cfg = EngineConfig(budget=req.budget, max_tokens=req.max_tokens, flash_attn=self.cfg.flash_attn,
                               hysteresis=self.cfg.hysteresis, kv_type=self.cfg.kv_type)
            return Engine(self.model, self.method(req.method), cfg)
        except PaskError as exc:
            raise bad_request(str(exc), "pask") from None

    def close(self) -> None:
        if self.prefix_dir is not None:
            self.prefix_dir.join(60)  # a prefix being saved finishes (its file is written atomically)
        self.pool.close()

    # ------------------------------------------------------------ routes
    async def chat(self, request: Request) -> Response:
        arrival = time.perf_counter()
        try:
            response = await self._chat(request, arrival)
        except APIError as exc:
            self.metrics.request(exc.status)
            if exc.status < 500:
                client_fault(request, exc.status, exc.code or exc.type, exc.message)
            return error_response(exc)
        except ClientDisconnect:
            self.metrics.request(499)
            client_fault(request, 499, "client_disconnect", "the connection closed while the body was sent")
            return Response(status_code=499)
        self.metrics.request(response.status_code)
        return response

    def _prepare(self, raw: bytes) -> tuple[ChatRequest, Engine, Prepared]:
        """The body parsed, validated, sized, rendered and tokenized (runs on a worker thread)."""
        body = parse_json_body(raw)
        self._check_message_size(body)
        req = parse_chat_request(body, self.cfg.model_id, self.cfg.defaults)
        engine = self.engine(req)
        try:
            prepared = engine.prepare(req.messages, req.tools, req.tool_choice, req.parallel, None, req.sampling)
        except ContextLengthError as exc:
            raise APIError(400, f"{exc}; shorten the messages or lower max_tokens", param="messages",
                           code="context_length_exceeded") from None
        except PaskError as exc:
            raise bad_request(str(exc)) from None
        limit = self.context_limit if self.batched else self.cfg.max_context
        if limit and prepared.n_prompt + req.max_tokens > limit:
            raise APIError(400, f"prompt ({prepared.n_prompt} tokens) + max_tokens ({req.max_tokens}) exceed this "
                           f"server's context limit ({limit}); shorten the messages or lower max_tokens",
                           param="messages", code="context_length_exceeded")
        try:
            self.pool.check(engine, prepared)
        except PaskError as exc:
            raise bad_request(str(exc), "pask") from None
        return req, engine, prepared

    def _check_message_size(self, body: Any) -> None:
        """Refuse, before rendering or tokenizing, messages whose text cannot fit the context."""
        chars = message_chars(body)
        if chars > self.max_message_chars:
            raise APIError(400, f"the messages hold {chars} non-blank characters, more than this server's context "
                           f"of {self.context_limit} tokens can take ({self.max_message_chars}); shorten the "
                           f"messages", param="messages", code="context_length_exceeded")

    async def _chat(self, request: Request, arrival: float) -> Response:
        raw = await self._read_body(request)
        if len(raw) > GATED_BODY_BYTES:  # large bodies take turns; a usual request is not held behind them
            async with self.gate.enter():
                req, engine, prepared = await run_in_threadpool(self._prepare, raw)
        else:
            req, engine, prepared = await run_in_threadpool(self._prepare, raw)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def push(item: tuple[str, Any]) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
                pass

        cancel = threading.Event()  # set when the client goes away: the pool stops the request
        try:
            future = self._submit(engine, prepared, arrival, push if req.stream else None, cancel)
        except QueueFull as exc:
            raise APIError(429, f"{exc}; retry later", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except PoolClosed:
            raise APIError(503, "the server is shutting down", type="server_error", code="cancelled") from None
        future.add_done_callback(lambda _f: push(("done", None)))
        if self.prefix_dir is not None:
            self.prefix_dir.offer(engine, req.messages, req.tools, req.parallel)
        if req.stream:
            return JobStream(cancel, self._stream(future, req, prepared, events))
        return await self._complete(request, future, cancel, req)

    async def _read_body(self, request: Request) -> bytes:
        """The body, at most ``max_body_bytes``, arrived within ``body_timeout`` seconds (408 otherwise)."""
        limit = self.cfg.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"the request body is larger than {limit >> 20} MiB", code="request_too_large")
        chunks: list[bytes] = []
        size = 0
        stream = request.stream()
        deadline = time.monotonic() + self.cfg.body_timeout
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.cfg.body_timeout:g} s",
                               code="request_timeout", headers={"Connection": "close"}) from None
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is larger than {limit >> 20} MiB", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _submit(self, engine: Engine, prepared: Prepared, arrival: float,
                push: Callable[[tuple[str, Any]], None] | None, cancel: threading.Event) -> Future[EngineResult]:
        """Submit to the pool, with the hook that streams and the metrics recorded when it ends."""
        first = last = 0.0
        n = 0

        def on_token(token: int) -> bool:  # on the pool's thread
            nonlocal first, last, n
            last = time.perf_counter()
            first = first or last
            n += 1
            if push is not None:
                push(("token", self.model.piece(token)))
            return cancel.is_set()

        def finished(future: Future[EngineResult]) -> None:
            exc = future.exception()
            if exc is not None:
                if not isinstance(exc, RequestCancelled) or exc.started:  # (a request that never ran is not counted)
                    reason = "cancelled" if isinstance(exc, RequestCancelled | PoolClosed) else "error"
                    self.metrics.finish(reason, None, None, None, time.perf_counter() - arrival)
                return
            result = future.result()
            reason = "cancelled" if result.finish == "cancelled" else (
                "error" if model_failure(result) else finish_reason(result))
            self.metrics.finish(reason, result.stats, first - arrival if n else None,
                                (last - first) / (n - 1) if n > 1 else None, (last or time.perf_counter()) - arrival)

        future = self.pool.submit(engine, prepared, on_token, cancelled=cancel.is_set)
        future.add_done_callback(finished)
        return future

    async def _complete(self, request: Request, future: Future[EngineResult], cancel: threading.Event,
                        req: ChatRequest) -> Response:
        fut = asyncio.wrap_future(future)
        while not fut.done():
            await asyncio.wait({fut}, timeout=DISCONNECT_POLL_S)
            if not fut.done() and await request.is_disconnected():
                cancel.set()
                return Response(status_code=499)  # nobody is listening
        try:
            result: EngineResult = fut.result()
        except (RequestCancelled, PoolClosed):
            raise APIError(503, "the request was cancelled (the server is shutting down)", type="server_error",
                           code="cancelled") from None
        except PaskError as exc:
            raise APIError(500, str(exc), type="server_error") from None
        failure = model_failure(result)
        if failure is not None:
            raise failure
        s = result.stats
        body = completion_body(completion_id(), now(), req.model, result.message.to_openai(), finish_reason(result),
                               usage(s), s)
        return JSONResponse(body)

    async def _stream(self, future: Future[EngineResult], req: ChatRequest, prepared: Prepared,
                      events: asyncio.Queue[tuple[str, Any]]) -> AsyncIterator[str]:
        plan = prepared.plan
        streamer = ReplyStreamer(plan.grammar is not None, plan.fmt.trigger if plan.fmt else None,
                                 plan.fmt.close if plan.fmt else None)
        cid, created = completion_id(), now()
        role_sent = False

        def chunk(delta: dict[str, Any]) -> str:
            nonlocal role_sent
            if not role_sent:
                delta = {"role": "assistant", **({"content": None} if "tool_calls" in delta else {}), **delta}
                role_sent = True
            return sse(chunk_body(cid, created, req.model, delta, None, req.include_usage))

        while True:
            try:
                kind, value = await asyncio.wait_for(events.get(), KEEPALIVE_S)
            except TimeoutError:
                yield SSE_KEEPALIVE
                continue
            if kind == "done":
                break
            for delta in streamer.feed_bytes(value):
                yield chunk(delta)
        try:
            result: EngineResult = future.result()
        except (RequestCancelled, PoolClosed):
            yield sse(error_body("the request was cancelled (the server is shutting down)", "server_error",
                                 code="cancelled"))
            yield SSE_DONE
            return
        except Exception as exc:  # an engine failure mid-stream: the status line has gone out already
            yield sse(error_body(str(exc) or type(exc).__name__, "server_error"))
            yield SSE_DONE
            return
        for delta in streamer.finish():
            yield chunk(delta)
        failure = model_failure(result)
        if failure is not None:
            yield sse(failure.body())
            yield SSE_DONE
            return
        if not role_sent:
            yield chunk({"content": ""})
        last = chunk_body(cid, created, req.model, {}, finish_reason(result), req.include_usage)
        last["pask"] = pask_stats(result.stats)  # the extension, as in a non-streamed response
        yield sse(last)
        if req.include_usage:
            yield sse(usage_chunk(cid, created, req.model, usage(result.stats)))
        yield SSE_DONE

    async def models(self, request: Request) -> Response:
        return JSONResponse(models_body(self.cfg.model_id, self.created))

    async def model_info(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name != self.cfg.model_id:
            return error_response(APIError(404, f"the model '{name}' does not exist", param="model",
                                           code="model_not_found"))
        return JSONResponse(models_body(self.cfg.model_id, self.created)["data"][0])

    async def health(self, request: Request) -> Response:
        body = {"status": "ok", "model": self.cfg.model_id, "slots": self.slots, "busy": self.pool.busy,
                "waiting": self.pool.waiting, "queue_capacity": self.cfg.queue_size, "batch": self.batched}
        if self.batched:
            body["pool"] = self.pool.stats()
        return JSONResponse(body)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)


class JobStream(StreamingResponse):
    """An SSE response that sets its request's cancel flag however the response ends (done, error,
    client gone)."""

    def __init__(self, cancel: threading.Event, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.cancel = cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cancel.set()


class _AsciiJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote input holding a lone surrogate."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(exc: APIError) -> JSONResponse:
    return _AsciiJSON(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _AsciiJSON(error_body(f"{request.method} {request.url.path}: {exc.detail}", "invalid_request_error"),
                        status_code=exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # a server fault: the traceback goes to the log, not to the client
    log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return _AsciiJSON(error_body(f"internal error ({type(exc).__name__}); see the server log", "server_error"),
                      status_code=500)


def client_fault(request: Request, status: int, code: str, message: str) -> None:
    """One log line per request refused for the client's own fault."""
    client = request.client.host if request.client else "?"
    log.warning("client fault from %s: %d %s: %s", client, status, code, message[:200])


def message_chars(body: Any) -> int:
    """Non-blank characters of the messages' text (content strings and text parts): every chat template
    renders them, so the prompt holds at least this many bytes."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return 0
    n = 0
    for m in body["messages"]:
        content = m.get("content") if isinstance(m, dict) else None
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            if isinstance(text, str):
                n += len(text) - sum(text.count(c) for c in " \t\n\r")
    return n


class PrepareGate:
    """At most ``workers`` requests in preparation at once, ``backlog`` more waiting; beyond: 429."""

    def __init__(self, workers: int, backlog: int) -> None:
        if workers < 1:
            raise ValueError("prepare workers must be >= 1")
        self.workers = workers
        self.limit = workers + backlog
        self.inside = 0
        self._sem: asyncio.Semaphore | None = None

    def enter(self) -> AbstractAsyncContextManager[None]:
        return self._enter()

    @asynccontextmanager
    async def _enter(self) -> AsyncIterator[None]:
        if self.inside >= self.limit:
            raise APIError(429, f"too many requests are being read ({self.inside}); retry later",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        if self._sem is None:  # made inside the serving loop
            self._sem = asyncio.Semaphore(self.workers)
        self.inside += 1
        try:
            async with self._sem:
                yield
        finally:
            self.inside -= 1


def create_app(server: Server) -> Starlette:
    """The ASGI app for ``server``; its pool is closed when the app shuts down."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        server.close()

    routes = [
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{name:path}", server.model_info, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(GuardMiddleware, guard=server.cfg.guard)],
                     exception_handlers={HTTPException: _http_error, Exception: _internal_error})
