"""The router with fake workers (pyzmq + core.messages, no torch), for tests/unit/test_router_*.py: the fakes
heartbeat, answer GenerateCmd as a Script says, and record every message they receive."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.core import ipc
from pdserve.core.messages import GenerateCmd, HeartbeatEvent, Message, RequestErrorEvent, Timings, TokenEvent, decode
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.server import RouterServer

HEARTBEAT_INTERVAL = 0.05
HEARTBEAT_TIMEOUT = 0.5


@dataclass
class Script:
    """What the fake workers do with every request."""

    tokens: list[int]
    finish_reason: str = "length"
    num_cached_tokens: int = 0
    decode_stall_after: int | None = None
    """The decode worker sends only this many of its tokens, then waits."""
    prefill_stall: bool = False
    """The prefill worker never answers."""
    prefill_error: tuple[str, str] | None = None
    """(gRPC code name, message) the prefill worker answers with instead of a token."""


class FakeWorker:
    """Binds its inbox, heartbeats the router and records every message it receives."""

    role = "prefill"

    def __init__(self, worker_id: int, run_dir: Path, ctx: zmq.asyncio.Context, script: Script) -> None:
        self.worker_id = worker_id
        self.script = script
        addr = ipc.prefill_addr if self.role == "prefill" else ipc.decode_addr
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(addr(run_dir, worker_id))
        self.to_router = ipc.connect_push(zmq.Context.shadow(ctx.underlying), ipc.router_addr(run_dir))
        self.incarnation = uuid.uuid4().hex
        self.heartbeating = False
        self.received: list[Message] = []
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._heartbeat()), asyncio.create_task(self._receive())]

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.inbox.close(linger=0)
        self.to_router.close(linger=0)

    def send(self, msg: Message) -> None:
        assert ipc.send(self.to_router, msg)

    def got(self, cls: type, request_id: str | None = None) -> list[Message]:
        """Messages of type cls received so far (for request_id only, if given)."""
        found = [m for m in self.received if isinstance(m, cls)]
        return found if request_id is None else [m for m in found if getattr(m, "request_id", None) == request_id]

    def handle(self, msg: Message) -> None:
        pass

    async def _heartbeat(self) -> None:
        while True:
            if self.heartbeating:
                hb = HeartbeatEvent(self.role, self.worker_id, os.getpid(), self.incarnation, 100, 128, 0, 0)
                ipc.send(self.to_router, hb)
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    async def _receive(self) -> None:
        while True:
            msg = decode(await self.inbox.recv())
            self.received.append(msg)
            self.handle(msg)


class FakeDecode(FakeWorker):
    """Sends tokens 1..n of each request it is told about, pairwise swapped and with a duplicate."""

    role = "decode"

    def begin(self, request_id: str, first: int = 1) -> None:
        """Stands in for the HandoffCmd a real prefill worker would send: tokens from index `first` on."""
        self.tasks.append(asyncio.create_task(self._emit(request_id, first)))

    async def _emit(self, request_id: str, first: int) -> None:
        tokens = self.script.tokens
        events = [TokenEvent(request_id, i, [tokens[i]]) for i in range(first, len(tokens))]
        events[-1:] = [TokenEvent(request_id, len(tokens) - 1, tokens[-1:], self.script.finish_reason)]
        events = events[: self.script.decode_stall_after]
        for k in range(0, len(events) - 1, 2):
            events[k], events[k + 1] = events[k + 1], events[k]
        for k, event in enumerate(events):
            self.send(event)
            if k == 1:
                self.send(events[0])  # a duplicate: must not show up twice
            await asyncio.sleep(0)


class FakePrefill(FakeWorker):
    """Answers GenerateCmd with token 0 (or an error), then tells the fake decode worker to go on."""

    def __init__(self, worker_id: int, run_dir: Path, ctx: zmq.asyncio.Context, script: Script) -> None:
        super().__init__(worker_id, run_dir, ctx, script)
        self.decode: list[FakeDecode] = []

    def handle(self, msg: Message) -> None:
        s = self.script
        if not isinstance(msg, GenerateCmd) or s.prefill_stall:
            return
        if s.prefill_error is not None:
            self.send(RequestErrorEvent(msg.request_id, *s.prefill_error))
            return
        t = msg.timings.arrival
        timings = Timings(arrival=t, prefill_start=t + 0.001, prefill_end=t + 0.003, first_token=t + 0.003)
        k = msg.sampling.num_generated  # NOTE: > 0 for a migrated request: its first new token is token k
        finish = s.finish_reason if len(s.tokens) == k + 1 else None
        num_prompt = len(msg.token_ids) // 4 - k  # NOTE: packed int32s
        self.send(TokenEvent(msg.request_id, k, s.tokens[k : k + 1], finish, num_prompt, s.num_cached_tokens, timings))
        if finish is None:
            self.decode[msg.decode_worker].begin(msg.request_id, k + 1)


@dataclass
class Harness:
    router: RouterServer
    prefill: FakePrefill
    decode: FakeDecode
    channel: grpc.aio.Channel
    stub: pb_grpc.GenerationStub = field(init=False)

    def __post_init__(self) -> None:
        self.stub = pb_grpc.GenerationStub(self.channel)

    async def generate(self, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        return [r async for r in self.stub.Generate(request)]

    async def health(self) -> int:
        reply = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=""))
        return int(reply.status)


@contextlib.asynccontextmanager
async def router_with_fakes(
    model_dir: Path, run_dir: Path, script: Script, heartbeat: bool = True, max_migrations: int = 0, **cfg_kw: Any
) -> AsyncIterator[Harness]:
    ctx = zmq.asyncio.Context()
    prefill, decode_ = FakePrefill(0, run_dir, ctx, script), FakeDecode(0, run_dir, ctx, script)
    prefill.decode = [decode_]
    cfg = RouterConfig(
        str(model_dir), str(run_dir), port=0, heartbeat_timeout=HEARTBEAT_TIMEOUT, max_migrations=max_migrations,
        **cfg_kw,
    )  # fmt: skip
    router = RouterServer(cfg)
    for fake in (prefill, decode_):
        fake.heartbeating = heartbeat
    if cfg.num_frontends > 1:  # NOTE: one of several front ends listens only once it sees workers
        prefill.start()
        decode_.start()
    await router.start()
    if cfg.num_frontends == 1:
        prefill.start()
        decode_.start()
    try:
        if heartbeat:
            await asyncio.wait_for(router.wait_ready(), 5.0)
        async with grpc.aio.insecure_channel(router.address) as channel:
            yield Harness(router, prefill, decode_, channel)
    finally:
        prefill.close()
        decode_.close()
        await router.stop(0)
        ctx.destroy(linger=0)


async def eventually(predicate: Callable[[], bool], timeout: float = 2.0) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        await asyncio.sleep(0.01)
    return time.monotonic() - start
