"""One generation request from arrival to its last response, whichever protocol carried it: validate, admit to
the workers (waiting for KV room), stream the workers' tokens back as pb.GenerateResponse objects, move the
request when its worker is lost, and free what the workers hold however the call ends.

The gRPC servicer (router/server.py) and the OpenAI-compatible HTTP API (router/http_api.py) are codecs over
this: each turns its client's request into a pb.GenerateRequest and the responses back into its own format.
A call the router refuses or fails raises RequestFailed, whose grpc.StatusCode each codec maps to its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import NamedTuple

import grpc

from pdserve.core.messages import RequestErrorEvent
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.router.admission import QueueFullError
from pdserve.router.dispatch import NoWorkerError
from pdserve.router.metrics import RouterMetrics, StreamClock
from pdserve.router.model_info import ModelSpec
from pdserve.router.outcome import CallEnd
from pdserve.router.requests import DuplicateRequestError, TrackedRequest, WorkerLost
from pdserve.router.stream import ResponseBuilder, TokenReorderer, merge
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.validation import RequestValidator, ValidationError
from pdserve.router.workers import WorkerHub

log = logging.getLogger(__name__)
REFUSALS: dict[type[Exception], grpc.StatusCode] = {
    ValidationError: grpc.StatusCode.INVALID_ARGUMENT,
    DuplicateRequestError: grpc.StatusCode.ALREADY_EXISTS,
    NoWorkerError: grpc.StatusCode.UNAVAILABLE,
    QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""What refuses a request before the workers have it, and the status the call ends with."""
REFUSED = tuple(REFUSALS)
MIGRATION_WAIT_S = 2.5
"""How long a request whose worker was lost waits for one to take it (e.g. its only decode worker, restarting);
with the heartbeat timeout (2 s) a stream that cannot move ends UNAVAILABLE within 5 s of the crash."""
MIGRATION_POLL_S = 0.05


class RequestFailed(Exception):
    """The router ended the call with `code` (not OK): refused before the workers had it, or failed after."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Admitted(NamedTuple):
    """A request the workers have, and the builder of its responses."""

    req: TrackedRequest
    builder: ResponseBuilder


class RequestPath:
    """Validates, dispatches through the WorkerHub and streams each request's tokens back. Every call has a
    CallEnd (open_call), filled in here and handed to `record` once when the codec is done with the call."""

    def __init__(
        self, model: ModelSpec, tokenizer: RouterTokenizer, hub: WorkerHub, max_migrations: int,
        metrics: RouterMetrics,
    ) -> None:  # fmt: skip
        self.model = model
        self.tokenizer = tokenizer
        self.validator = RequestValidator(model, tokenizer)
        self.hub = hub
        self.max_migrations = max_migrations
        self.metrics = metrics

    def open_call(self) -> CallEnd:
        """A new call's CallEnd; its clock starts now (the request's arrival)."""
        return CallEnd(StreamClock(self.metrics, time.time()))

    def record(self, call: CallEnd) -> None:
        """The one place a call's end is counted and logged: once, when the codec is done with it."""
        outcome = call.outcome()
        now = time.time()
        call.clock.ended(outcome, call.finish_reason, now)
        log.info("%s", call.describe(outcome, now))

    async def generate(self, request: pb.GenerateRequest, call: CallEnd) -> AsyncGenerator[pb.GenerateResponse, None]:
        """admit, then stream; what the workers hold is freed however it ends (the gRPC servicer's whole call)."""
        try:
            admitted = await self.admit(request, call)
            async with contextlib.aclosing(self.stream(admitted, call)) as responses:
                async for response in responses:
                    yield response
        finally:
            self.finish(call)

    async def admit(self, request: pb.GenerateRequest, call: CallEnd) -> Admitted:
        """Validate request and hand it to workers (waiting for KV room); call.req is set once they have it.
        RequestFailed when refused. The caller owes a finish(call) from the moment this is called."""
        call.request_id = request.request_id or uuid.uuid4().hex
        try:
            # NOTE: tokenizing a long text or rendering a template must not stall the other streams; token ids
            # are only range-checked, cheaper than the hop to a thread (the exact-hit TTFT path).
            if request.WhichOneof("input") == "token_ids":
                valid = self.validator.validate(request)
            else:
                valid = await asyncio.to_thread(self.validator.validate, request)
            arrival = call.clock.arrival
            req = call.req = await self.hub.admit(call.request_id, valid.token_ids, valid.sampling, arrival)
        except REFUSED as exc:
            raise self._fail(call, REFUSALS[type(exc)], str(exc)) from None
        except BaseException as exc:  # NOTE: the client's cancel too: it decides the outcome
            call.error = exc
            raise
        self.metrics.prompt_tokens.inc(len(valid.token_ids))
        builder = ResponseBuilder(call.request_id, valid.token_ids, valid.sampling, valid.stop, self.tokenizer,
                                  arrival)  # fmt: skip
        call.builder = builder
        return Admitted(req, builder)

    async def stream(self, admitted: Admitted, call: CallEnd) -> AsyncGenerator[pb.GenerateResponse, None]:
        """An admitted request's responses, each counted into the call's clock as it leaves; RequestFailed when
        the workers fail it. Close it (aclosing) and finish(call) when done."""
        try:
            async for response in self._responses(admitted, call):
                call.clock.sent(len(response.token_ids), time.time())
                yield response
            call.end(grpc.StatusCode.OK)
        except RequestFailed:
            raise
        except BaseException as exc:  # NOTE: a client that leaves: CancelledError, or GeneratorExit at the yield
            call.error = exc
            raise

    def finish(self, call: CallEnd) -> None:
        """The workers drop call's request unless they finished it, and the router forgets it; idempotent.
        NOTE: runs on client cancel, errors and stop strings alike: workers free what they hold."""
        if call.req is None or call.released:
            return
        call.released = True
        if call.builder is None or not call.builder.worker_finished:
            self.hub.abort(call.req)
        self.hub.release(call.request_id)

    async def _responses(self, admitted: Admitted, call: CallEnd) -> AsyncGenerator[pb.GenerateResponse, None]:
        """One response per wake-up: everything that arrived meanwhile goes out together (see stream.merge).
        A lost worker or a failed KV transfer moves the request to other workers (migrate) when it may."""
        req, builder = admitted
        reorderer = TokenReorderer()
        generated: list[int] = []
        while not builder.finished:
            items = [await req.inbox.get()]
            while not req.inbox.empty():
                items.append(req.inbox.get_nowait())
            events = []
            for item in items:
                if isinstance(item, WorkerLost) and item.attempt != req.attempt:
                    continue  # NOTE: a second loss of an attempt already left behind
                if isinstance(item, (WorkerLost, RequestErrorEvent)):
                    if await self._migrate(req, item, generated):
                        continue
                    raise self._fail(call, status_code(item.code), item.message)
                new = reorderer.push(item)
                for event in new:
                    generated += event.token_ids
                events += new
            if events:
                yield builder.build(merge(events), time.time())

    async def _migrate(
        self, req: TrackedRequest, failure: WorkerLost | RequestErrorEvent, generated: list[int]
    ) -> bool:
        """Send req again (prompt + generated) to workers that are up, waiting up to MIGRATION_WAIT_S for one;
        False when it may not move (migration off, retries used up, not a worker failure) or none came up."""
        if failure.code != "UNAVAILABLE" or req.attempt >= self.max_migrations:
            return False
        deadline = time.monotonic() + MIGRATION_WAIT_S
        while True:
            try:
                self.hub.migrate(req, generated)
            except NoWorkerError:
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(MIGRATION_POLL_S)
                continue
            what = f"{failure.message}; migrated with {len(generated)} tokens (attempt {req.attempt})"
            log.info("%s: %s", req.request_id, what)
            return True

    @staticmethod
    def _fail(call: CallEnd, code: grpc.StatusCode, message: str) -> RequestFailed:
        call.end(code, message)
        return RequestFailed(code, message)


def status_code(name: str) -> grpc.StatusCode:
    """A worker's gRPC status name; INTERNAL for OK or a name gRPC does not have."""
    code = getattr(grpc.StatusCode, name, None)
    return code if isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK else grpc.StatusCode.INTERNAL
