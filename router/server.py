"""The router's gRPC server: pdserve.v1.Generation, plus grpc.health.v1 (SERVING while at least one prefill
and one decode worker are up) and server reflection."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.core.gc_pauses import GcPauses, freeze_startup_heap
from pdserve.core.lifecycle import READY_LINE
from pdserve.core.messages import MAX_MESSAGE_BYTES, RequestErrorEvent
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.router import auth
from pdserve.router.admission import QueueFullError
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import NoWorkerError
from pdserve.router.metrics import RouterMetrics, StreamClock
from pdserve.router.model_info import ModelSpec
from pdserve.router.outcome import CURRENT_CALL, CallAccounting, CallEnd
from pdserve.router.requests import DuplicateRequestError, TrackedRequest, WorkerLost
from pdserve.router.stream import ResponseBuilder, TokenReorderer, merge
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.validation import RequestValidator, ValidationError
from pdserve.router.workers import WorkerHub

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"
REFUSALS: dict[type[Exception], grpc.StatusCode] = {
    ValidationError: grpc.StatusCode.INVALID_ARGUMENT,
    DuplicateRequestError: grpc.StatusCode.ALREADY_EXISTS,
    NoWorkerError: grpc.StatusCode.UNAVAILABLE,
    QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""What refuses a request before the workers have it, and the status the call ends with."""
REFUSED = tuple(REFUSALS)
PENDING_CALL_LIMITS = [
    ("grpc.server.max_pending_requests", 16384),
    ("grpc.server.max_pending_requests_hard_limit", 32768),
]
"""Calls gRPC core accepts before the Python side picks them up (defaults 1000 / 3000): past them a burst's
extra calls are cancelled with no status the client can act on; these let them reach admission control
(router/admission.py), which queues or refuses them RESOURCE_EXHAUSTED."""
MIGRATION_WAIT_S = 2.5
"""How long a request whose worker was lost waits for one to take it (e.g. its only decode worker, restarting);
with the heartbeat timeout (2 s) a stream that cannot move ends UNAVAILABLE within 5 s of the crash."""
MIGRATION_POLL_S = 0.05


class Admitted(NamedTuple):
    """A request the workers have, and the builder of its responses."""

    req: TrackedRequest
    builder: ResponseBuilder


class GenerationServicer(pb_grpc.GenerationServicer):
    """Validates, dispatches through the WorkerHub and streams each request's tokens back. Its server must
    carry accounting() as an interceptor: that opens the CallEnd Generate fills in, and records it."""

    def __init__(
        self, model: ModelSpec, tokenizer: RouterTokenizer, hub: WorkerHub, block_size: int | None,
        max_migrations: int, metrics: RouterMetrics,
    ) -> None:  # fmt: skip
        self.max_migrations = max_migrations
        self.metrics = metrics
        self.model = model
        self.tokenizer = tokenizer
        self.validator = RequestValidator(model, tokenizer)
        self.hub = hub
        self.block_size = block_size

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        m = self.model
        info = pb.ModelInfo(
            model_name=m.name, vocab_size=m.vocab_size, max_model_len=m.max_model_len, eos_token_ids=m.eos_token_ids
        )
        if self.block_size is not None:
            info.block_size = self.block_size
        return info

    def accounting(self) -> CallAccounting:
        """The interceptor that opens and records every Generate call's CallEnd (install it on the server)."""
        return CallAccounting(GENERATE_METHOD, lambda: CallEnd(StreamClock(self.metrics, time.time())), self._record)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = CURRENT_CALL.get()
        call.request_id, call.context = request.request_id or uuid.uuid4().hex, context
        try:
            try:
                req, builder = await self._admit(request, call)
            except REFUSED as exc:
                call.end(REFUSALS[type(exc)], str(exc))
                await context.abort(REFUSALS[type(exc)], str(exc))
                return
            async for response in self._stream(req, builder, context, call):
                call.clock.sent(len(response.token_ids), time.time())
                yield response
            call.end(grpc.StatusCode.OK)
        except BaseException as exc:  # NOTE: the client's cancel too: it decides the outcome
            call.error = exc
            raise
        finally:
            # NOTE: runs on client cancel, errors and stop strings alike: workers free what they hold.
            if call.req is not None:
                if call.builder is None or not call.builder.worker_finished:
                    self.hub.abort(call.req)
                self.hub.release(call.request_id)

    async def _admit(self, request: pb.GenerateRequest, call: CallEnd) -> Admitted:
        """Validate request and hand it to workers (waiting for KV room); call.req is set once they have it."""
        # NOTE: tokenizing a long text or rendering a template must not stall the other streams; token ids
        # are only range-checked, cheaper than the hop to a thread (the exact-hit TTFT path).
        if request.WhichOneof("input") == "token_ids":
            valid = self.validator.validate(request)
        else:
            valid = await asyncio.to_thread(self.validator.validate, request)
        req = call.req = await self.hub.admit(call.request_id, valid.token_ids, valid.sampling, call.clock.arrival)
        self.metrics.prompt_tokens.inc(len(valid.token_ids))
        builder = ResponseBuilder(call.request_id, valid.token_ids, valid.sampling, valid.stop, self.tokenizer,
                                  call.clock.arrival)  # fmt: skip
        call.builder = builder
        return Admitted(req, builder)

    def _record(self, call: CallEnd) -> None:
        """The one place a call's end is counted and logged: once, when its task is done."""
        outcome = call.outcome()
        now = time.time()
        call.clock.ended(outcome, call.finish_reason, now)
        log.info("%s", call.describe(outcome, now))

    async def _stream(
        self, req: TrackedRequest, builder: ResponseBuilder, context: grpc.aio.ServicerContext, call: CallEnd
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One response per wake-up: everything that arrived meanwhile goes out together (see stream.merge).
        A lost worker or a failed KV transfer moves the request to other workers (migrate) when it may."""
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
                    call.end(_status_code(item.code), item.message)
                    await context.abort(_status_code(item.code), item.message)
                    return
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


class RouterServer:
    """The gRPC server and the WorkerHub of one router process. Create it inside the running event loop."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        model = ModelSpec.from_dir(cfg.model_dir)
        tokenizer = RouterTokenizer.from_dir(cfg.model_dir)
        self.hub = WorkerHub(cfg)
        self.gc_pauses = GcPauses()
        self.metrics = RouterMetrics(self.hub, self.gc_pauses)
        servicer = GenerationServicer(model, tokenizer, self.hub, cfg.block_size, cfg.max_migrations, self.metrics)
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *PENDING_CALL_LIMITS]
        # NOTE: the API-key check runs first: a refused call is never accounted nor seen by the servicer
        interceptors = [*auth.interceptors(cfg.security), servicer.accounting()]
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        pb_grpc.add_GenerationServicer_to_server(servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        services = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(services, self.server)
        self._health_tasks: set[asyncio.Task[None]] = set()
        self.hub.listeners.append(self._set_health)
        self.port = 0

    async def start(self) -> int:
        """Listen (port 0 picks one) and start talking to the workers; the port."""
        self.port = auth.add_port(self.server, self.cfg.bind, self.cfg.address, self.cfg.security)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.cfg.address}")
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        self.hub.start()
        if self.cfg.metrics_port is not None:
            port = self.metrics.serve(self.cfg.metrics_port, Path(self.cfg.run_dir) / "metrics" / "router.port")
            log.info("metrics on http://127.0.0.1:%d/metrics", port)
        log.info("froze %d startup objects out of the garbage collector's scans", freeze_startup_heap(self.gc_pauses))
        return self.port

    @property
    def address(self) -> str:
        """host:port actually listened on."""
        return dataclasses.replace(self.cfg, port=self.port).address

    async def wait_ready(self) -> None:
        """Until every configured prefill and decode worker has sent a heartbeat."""
        await self.hub.serving.wait()
        live = self.hub.liveness
        while len(live.up("prefill")) < self.cfg.num_prefill or len(live.up("decode")) < self.cfg.num_decode:
            await asyncio.sleep(0.05)

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new calls, let streams in flight finish within `grace` seconds, then close the sockets."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await self.hub.close()
        log.info("garbage collector: %s", self.gc_pauses.summary())
        self.gc_pauses.close()

    def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            task = asyncio.create_task(self.health.set(service, status))
            self._health_tasks.add(task)
            task.add_done_callback(self._health_tasks.discard)


class StartupError(RuntimeError):
    """The router cannot start (bad model folder, port in use, ...)."""


async def serve(cfg: RouterConfig) -> None:
    """Run the router until SIGTERM / SIGINT; print the ready line once workers of both roles are up."""
    try:
        router = RouterServer(cfg)
        await router.start()
    except (OSError, ValueError, RuntimeError) as exc:
        raise StartupError(str(exc)) from exc
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    announce = asyncio.create_task(_announce(router))
    await stop.wait()
    log.info("stopping (grace %.1fs)", cfg.grace_s)
    announce.cancel()
    await router.stop(cfg.grace_s)


async def _announce(router: RouterServer) -> None:
    await router.wait_ready()
    print(READY_LINE.format(address=router.address), flush=True)


def _status_code(name: str) -> grpc.StatusCode:
    """A worker's gRPC status name; INTERNAL for OK or a name gRPC does not have."""
    code = getattr(grpc.StatusCode, name, None)
    return code if isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK else grpc.StatusCode.INTERNAL
