"""The router's gRPC server: pdserve.v1.Generation, plus grpc.health.v1 (SERVING while at least one prefill
and one decode worker are up) and server reflection; beside it, on its own port in the same event loop, the
OpenAI-compatible HTTP API (router/http_api.py). Both are codecs over one request path (router/request_path.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.core.gc_pauses import GcPauses, freeze_startup_heap
from pdserve.core.lifecycle import READY_LINE
from pdserve.core.messages import MAX_MESSAGE_BYTES
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.router import auth
from pdserve.router.config import HTTP_READY, RouterConfig
from pdserve.router.http_api import HttpServer, OpenAiApi
from pdserve.router.metrics import RouterMetrics
from pdserve.router.model_info import ModelSpec
from pdserve.router.outcome import CURRENT_CALL, CallAccounting
from pdserve.router.request_path import RequestFailed, RequestPath
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.workers import WorkerHub

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"
PENDING_CALL_LIMITS = [
    ("grpc.server.max_pending_requests", 16384),
    ("grpc.server.max_pending_requests_hard_limit", 32768),
]
"""Calls gRPC core accepts before the Python side picks them up (defaults 1000 / 3000): past them a burst's
extra calls are cancelled with no status the client can act on; these let them reach admission control
(router/admission.py), which queues or refuses them RESOURCE_EXHAUSTED."""


class GenerationServicer(pb_grpc.GenerationServicer):
    """The gRPC codec of the request path (router/request_path.py). Its server must carry accounting() as an
    interceptor: that opens the CallEnd Generate fills in, and records it."""

    def __init__(self, path: RequestPath, block_size: int | None) -> None:
        self.path = path
        self.block_size = block_size

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        m = self.path.model
        info = pb.ModelInfo(
            model_name=m.name, vocab_size=m.vocab_size, max_model_len=m.max_model_len, eos_token_ids=m.eos_token_ids
        )
        if self.block_size is not None:
            info.block_size = self.block_size
        return info

    def accounting(self) -> CallAccounting:
        """The interceptor that opens and records every Generate call's CallEnd (install it on the server)."""
        return CallAccounting(GENERATE_METHOD, self.path.open_call, self.path.record)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = CURRENT_CALL.get()
        call.time_remaining = context.time_remaining
        try:
            async with contextlib.aclosing(self.path.generate(request, call)) as responses:
                async for response in responses:
                    yield response
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message)


class RouterServer:
    """The gRPC server and the WorkerHub of one router process. Create it inside the running event loop."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        model = ModelSpec.from_dir(cfg.model_dir)
        tokenizer = RouterTokenizer.from_dir(cfg.model_dir)
        self.hub = WorkerHub(cfg)
        self.gc_pauses = GcPauses()
        self.metrics = RouterMetrics(self.hub, self.gc_pauses)
        self.path = RequestPath(model, tokenizer, self.hub, cfg.max_migrations, self.metrics)
        servicer = GenerationServicer(self.path, cfg.block_size)
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *PENDING_CALL_LIMITS]
        # NOTE: SO_REUSEPORT only where front ends share the port (the kernel spreads connections over them); gRPC
        # sets it by default, which would let another process silently take a share of a lone router's port
        options.append(("grpc.so_reuseport", int(cfg.num_frontends > 1)))
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
        self.http = None if cfg.http_port is None else self._http_server(cfg)
        self.http_port = 0

    async def start(self) -> int:
        """Listen (port 0 picks one) and start talking to the workers; the port. One of several front ends
        listens only once it serves (a worker of each role up): the kernel hands a shared port's new connections
        to every listener alike, and one that cannot serve yet (a restarted front end) would refuse its share."""
        if self.cfg.num_frontends > 1:
            self.hub.start()
            await self.hub.serving.wait()
        self.port = auth.add_port(self.server, self.cfg.bind, self.cfg.address, self.cfg.security)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.cfg.address}")
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.http is not None:
            assert self.cfg.http_port is not None
            self.http_port = await self.http.start(self.cfg.bind, self.cfg.http_port, self.cfg.num_frontends > 1)
        if self.cfg.num_frontends == 1:
            self.hub.start()
        if self.cfg.metrics_port is not None:
            port = self.metrics.serve(self.cfg.metrics_port, Path(self.cfg.run_dir) / "metrics" / f"{self.name}.port")
            log.info("metrics on http://127.0.0.1:%d/metrics", port)
        log.info("froze %d startup objects out of the garbage collector's scans", freeze_startup_heap(self.gc_pauses))
        return self.port

    @property
    def name(self) -> str:
        """router, or router-{k} for front end k of several (the supervisor's name for this process)."""
        return "router" if self.cfg.num_frontends == 1 else f"router-{self.cfg.frontend}"

    @property
    def address(self) -> str:
        """host:port actually listened on."""
        return dataclasses.replace(self.cfg, port=self.port).address

    @property
    def http_url(self) -> str | None:
        """The HTTP API's base URL (scheme://host:port), None without HTTP."""
        if self.http is None:
            return None
        scheme = "https" if self.cfg.security.tls else "http"
        return f"{scheme}://{dataclasses.replace(self.cfg, port=self.http_port).address}"

    def _http_server(self, cfg: RouterConfig) -> HttpServer:
        check = cfg.security.bearer_ok if cfg.security.api_keys else None
        api = OpenAiApi(self.path, self.hub.serving, check)
        return HttpServer(api.app(), cfg.grace_s, auth.uvicorn_tls(cfg.security))

    async def wait_ready(self) -> None:
        """Until every configured prefill and decode worker has sent a heartbeat."""
        await self.hub.serving.wait()
        live = self.hub.liveness
        while len(live.up("prefill")) < self.cfg.num_prefill or len(live.up("decode")) < self.cfg.num_decode:
            await asyncio.sleep(0.05)

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new calls, let streams in flight finish within `grace` seconds, then close the sockets."""
        await self.health.enter_graceful_shutdown()
        await asyncio.gather(self.server.stop(grace), *([] if self.http is None else [self.http.stop()]))
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
    url = router.http_url
    print(READY_LINE.format(address=router.address) + ("" if url is None else HTTP_READY.format(url=url)), flush=True)
