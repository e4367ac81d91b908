"""The router's OpenAI-compatible HTTP API (Starlette on uvicorn, in the router's own event loop): POST
/v1/completions and /v1/chat/completions (whole, or streamed as server-sent events ending `data: [DONE]`), GET
/v1/models and GET /health.

A codec over the request path (router/request_path.py), like the gRPC servicer: the same validation, admission,
streaming, metrics and per-call log line. A client that disconnects, at any point of the call, cancels it: the
workers drop the request and free its KV blocks at once. Errors have OpenAI's shape, with the status codes
clients retry on (429, 503) or not (400).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, TypeVar

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.router.openai_request import ApiError, Kind, parse_request
from pdserve.router.openai_response import ResponseRenderer, error_body, param_of
from pdserve.router.outcome import CallEnd
from pdserve.router.request_path import Admitted, RequestFailed, RequestPath

log = logging.getLogger(__name__)
T = TypeVar("T")
AuthCheck = Callable[[str | None], bool]
"""Whether an Authorization header value (None: absent) may use the API."""
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
}
"""A refusal's or failure's HTTP status and OpenAI error type; any other status is 500 server_error."""
CLIENT_CLOSED = 499
"""The status logged for a call whose client left (nginx's; the client never sees it)."""
ID_PREFIX: dict[Kind, str] = {"completion": "cmpl-", "chat": "chatcmpl-"}
OPEN_PATHS = frozenset({"/health"})
"""Reachable without an API key (load balancers and probes do not authenticate)."""
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before the response started."""


class OpenAiApi:
    """The Starlette app of one router: its routes call into the request path."""

    def __init__(self, path: RequestPath, serving: asyncio.Event, check_auth: AuthCheck | None = None) -> None:
        self.path = path
        self.serving = serving
        self.check_auth = check_auth
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        middleware = [] if self.check_auth is None else [Middleware(ApiKeyMiddleware, check=self.check_auth)]
        return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: _http_error})

    async def completions(self, http: Request) -> Response:
        return await self._generate(http, "completion")

    async def chat_completions(self, http: Request) -> Response:
        return await self._generate(http, "chat")

    async def models(self, http: Request) -> Response:
        m = self.path.model
        card = {"id": m.name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "max_model_len": m.max_model_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, http: Request) -> Response:
        """200 while workers of both roles are up (as gRPC health's SERVING), else 503."""
        serving = self.serving.is_set()
        return JSONResponse({"status": "serving" if serving else "not_serving"}, status_code=200 if serving else 503)

    async def _generate(self, http: Request, kind: Kind) -> Response:
        """One call: parse, admit (refusals get their status), then the whole response or its event stream. The
        call is recorded once: here, or when the stream's response is done."""
        call = self.path.open_call()
        call.request_id = ID_PREFIX[kind] + uuid.uuid4().hex
        streams = False
        try:
            api = parse_request(kind, await http.body(), self.path.model.name, call.request_id)
            admitted = await until_disconnected(http, self.path.admit(api.request, call))
            renderer = ResponseRenderer(api, self.path.model.name, self.path.tokenizer, int(call.clock.arrival))
            if api.stream:
                streams = True
                return SseResponse(self._events(renderer, admitted, call), lambda: self._close(call))
            return JSONResponse(renderer.whole(await until_disconnected(http, self._collect(admitted, call))))
        except ApiError as exc:
            call.end(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            return _error(exc.status, error_body(exc.message, "invalid_request_error", exc.param, exc.code))
        except RequestFailed as exc:
            return _error(*_failure(exc, kind))
        except (ClientGone, ClientDisconnect):
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:  # NOTE: a bug: the call ends "internal", the client gets a 500 in OpenAI's shape
            call.error = exc
            log.exception("%s: internal error", call.request_id)
            return _error(500, error_body("internal server error", "server_error", code="internal"))
        finally:
            if not streams:
                self._close(call)

    async def _collect(self, admitted: Admitted, call: CallEnd) -> list[pb.GenerateResponse]:
        async with contextlib.aclosing(self.path.stream(admitted, call)) as responses:
            return [r async for r in responses]

    async def _events(
        self, renderer: ResponseRenderer, admitted: Admitted, call: CallEnd
    ) -> AsyncGenerator[bytes, None]:
        """The stream's events; a failure after the first byte is an error event (the status is sent by then)."""
        try:
            for chunk in renderer.first_chunks():
                yield sse(chunk)
            async with contextlib.aclosing(self.path.stream(admitted, call)) as responses:
                async for response in responses:
                    for chunk in renderer.chunks(response):
                        yield sse(chunk)
        except RequestFailed as exc:
            yield sse(_failure(exc, renderer.api.kind)[1])
        except Exception as exc:  # NOTE: a bug; what the request path recorded (its stream closed) is not the cause
            call.error = exc
            log.exception("%s: internal error", call.request_id)
            yield sse(error_body("internal server error", "server_error", code="internal"))
        yield DONE

    def _close(self, call: CallEnd) -> None:
        self.path.finish(call)
        self.path.record(call)


class SseResponse(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends, then on_close runs: a client
    that leaves mid-stream frees the request's blocks at once, not when the generator is collected."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> None:
        super().__init__(events, headers={"cache-control": "no-cache"})
        self.events, self.on_close = events, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()
            self.on_close()


class ApiKeyMiddleware:
    """Refuses (401, OpenAI's shape) every HTTP request but OPEN_PATHS whose Authorization header `check` rejects."""

    def __init__(self, app: ASGIApp, check: AuthCheck) -> None:
        self.app, self.check = app, check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        open_path = scope["type"] != "http" or scope["path"] in OPEN_PATHS
        if not open_path and not self.check(Headers(scope=scope).get("authorization")):
            body = error_body("missing or invalid API key", "invalid_request_error", code="invalid_api_key")
            await _error(401, body)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class HttpServer:
    """uvicorn serving an ASGI app inside the running event loop, on a socket it binds itself."""

    def __init__(self, app: ASGIApp, grace_s: float, tls: dict[str, Any]) -> None:
        config = uvicorn.Config(
            app, lifespan="off", log_config=None, access_log=False, proxy_headers=False,
            timeout_graceful_shutdown=max(1, round(grace_s)), **tls,
        )  # fmt: skip
        self.server = EmbeddedServer(config)
        self.task: asyncio.Task[None] | None = None

    async def start(self, bind: str, port: int, reuse_port: bool = False) -> int:
        """Listen on bind:port (0 picks a free one; reuse_port: shared with the other front ends); the port.
        OSError when it cannot."""
        sock = listening_socket(bind, port, reuse_port)
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise OSError(f"HTTP server on {bind}:{port} stopped while starting")
            await asyncio.sleep(0.01)
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        """Stop listening, let responses in flight finish within the grace, then cancel them."""
        if self.task is not None:
            self.server.should_exit = True
            await self.task


LISTEN_BACKLOG = 2048
"""Connections the kernel queues before uvicorn accepts them (uvicorn's own default)."""


def listening_socket(bind: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP listener on bind:port (0 picks a free one); reuse_port: SO_REUSEPORT, so that the router processes
    of one cluster listen on one port and the kernel spreads new connections over them. NOTE: made with proto
    IPPROTO_TCP: asyncio sets TCP_NODELAY only on connections of such a socket (socket.create_server's proto 0
    leaves Nagle on, and a response's headers then hold its first SSE chunk back until the client's delayed ACK,
    ~40 ms)."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((bind, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


class EmbeddedServer(uvicorn.Server):
    """A uvicorn Server that leaves signals to the loop's owner (the router stops it on SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


async def until_disconnected(http: Request, work: Coroutine[Any, Any, T]) -> T:
    """work's result; ClientGone once the client disconnected first (work is then cancelled, and its cleanup
    done, before this returns)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(http))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.wait((task, gone))
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _disconnect(http: Request) -> None:
    """Returns when the client disconnects (the request's body must have been read)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _failure(exc: RequestFailed, kind: Kind) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body of a call the request path refused or failed."""
    status, kind_name = HTTP_STATUS.get(exc.code, (500, "server_error"))
    param = param_of(exc.message, kind) if exc.code == grpc.StatusCode.INVALID_ARGUMENT else None
    return status, error_body(exc.message, kind_name, param, exc.code.name.lower())


def _error(status: int, body: dict[str, Any]) -> JSONResponse:
    return JSONResponse(body, status_code=status)


async def _http_error(http: Request, exc: Exception) -> Response:
    """Starlette's own refusals (unknown path 404, wrong method 405) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, error_body(str(exc.detail), "invalid_request_error"))
