"""How a generation call ended, over gRPC or HTTP: one outcome per call the router accepted, counted in
pdserve_requests_total{outcome} and logged once at INFO (router/request_path.py RequestPath.record).

For gRPC, CallAccounting (a server interceptor) opens a CallEnd for each Generate call as gRPC starts the call's
task, before the request is even read, and hands it to `record` when that task ends, whatever ended it: a call
the client cancels before its handler runs is counted like every other. The HTTP front end (router/http_api.py)
opens one as its handler starts and records it once the response is done. The request path fills the CallEnd
in as it goes (request id, the status it ended the call with, the workers' request); the outcome follows from
what it holds at the end. A client that disconnects is CANCELLED on either protocol.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING

import grpc

from pdserve.router.requests import TrackedRequest
from pdserve.router.stream import FINISH_REASONS, ResponseBuilder

if TYPE_CHECKING:
    from pdserve.router.metrics import StreamClock

OK = "ok"
BY_STATUS = {
    grpc.StatusCode.OK: OK,
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.ALREADY_EXISTS: "already_exists",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
}
"""Outcome of a call the router ended with this status; any other status is "internal"."""
CANCELLED_BEFORE_ADMISSION = "cancelled_before_admission"
CANCELLED = "cancelled"
DEADLINE_EXCEEDED = "deadline_exceeded"
INTERNAL = "internal"
OUTCOMES = (*BY_STATUS.values(), CANCELLED_BEFORE_ADMISSION, CANCELLED, DEADLINE_EXCEEDED, INTERNAL)
"""Every outcome, in the order docs/operations.md lists them."""
CLIENT_GONE = (asyncio.CancelledError, GeneratorExit)
"""What stops the handler when the client cancels or its deadline passes: the task is cancelled while it waits,
or the stream is closed while it waits at a yield."""
FINISH_NAMES = {code: name for name, code in FINISH_REASONS.items()}
CURRENT_CALL: ContextVar[CallEnd] = ContextVar("pdserve_call")
"""The CallEnd of the call whose task this is (set by CallAccounting, read by the handler)."""


@dataclasses.dataclass
class CallEnd:
    """One call's progress, filled in as it goes, read once when its task ends."""

    clock: StreamClock
    request_id: str = ""
    """Empty until the handler has read the request."""
    time_remaining: Callable[[], float | None] | None = None
    """Seconds left before the client's deadline (gRPC's context.time_remaining); None: no deadline."""
    status: grpc.StatusCode | None = None
    """The status the router ended the call with (OK once the last response left); None while it goes on. HTTP
    maps it to its own codes (router/http_api.py)."""
    message: str = ""
    """The status's details, for the log line."""
    error: BaseException | None = None
    """What stopped the handler when it raised."""
    req: TrackedRequest | None = None
    """Set once admitted: the workers have it."""
    builder: ResponseBuilder | None = None
    released: bool = False
    """The workers were told to drop the request (or had finished it) and the router forgot it."""

    @property
    def finish_reason(self) -> str:
        """ "stop", "length" or "abort" once the stream finished, else "none"."""
        return "none" if self.builder is None else FINISH_NAMES.get(self.builder.finish_reason, "none")

    def end(self, status: grpc.StatusCode, message: str = "") -> None:
        self.status, self.message = status, message

    def outcome(self) -> str:
        if self.status is not None:
            return BY_STATUS.get(self.status, INTERNAL)
        if self.error is not None and not isinstance(self.error, CLIENT_GONE):
            return INTERNAL  # NOTE: a bug in the handler: gRPC ends the call UNKNOWN
        remaining = None if self.time_remaining is None else self.time_remaining()
        if remaining is not None and remaining <= 0:
            return DEADLINE_EXCEEDED
        return CANCELLED if self.req is not None else CANCELLED_BEFORE_ADMISSION

    def describe(self, outcome: str, now: float) -> str:
        """The call's INFO log line."""
        head = f"request {self.request_id or '-'} {outcome}"
        e2e = f"e2e_ms={(now - self.clock.arrival) * 1e3:.1f}"
        b, req = self.builder, self.req
        if b is None or req is None:
            why = self.message or (repr(self.error) if outcome == INTERNAL else "")
            why = why or ("" if self.request_id else "the client left before the router read the request")
            return f"{head} {e2e}" + (f": {why}" if why else "")
        return (
            f"{head} finish={self.finish_reason} prompt={b.num_prompt_tokens} cached={b.num_cached_tokens} "
            f"generated={b.num_generated} ttft_ms={self.clock.ttft_ms():.1f} {e2e} workers={req.prefill_worker}/"
            f"{req.decode_worker} attempts={req.attempt + 1}" + (f": {self.message}" if self.message else "")
        )


class CallAccounting(grpc.aio.ServerInterceptor):
    """Opens a CallEnd (`start`) for every call of `method` as its task starts, and passes it to `record` once
    the task is done. NOTE: gRPC runs interceptors in the call's own task, the handler's too."""

    def __init__(self, method: str, start: Callable[[], CallEnd], record: Callable[[CallEnd], None]) -> None:
        self.method, self.start, self.record = method, start, record

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        task = asyncio.current_task()
        if handler_call_details.method == self.method and task is not None:
            call = self.start()
            CURRENT_CALL.set(call)
            task.add_done_callback(lambda _: self.record(call))
        return await continuation(handler_call_details)
