#!/usr/bin/env python3
"""Host latency floors under pdserve's exact-hit TTFT, on this machine: a ZeroMQ ipc round trip between two
processes (blocking poll vs spinning), a Python grpc.aio Generate that answers at once (1000 token ids in, one
response out), called like `pdserve-bench-serving` calls the router, and how long such a server takes to start a
new call's handler while it streams to N other calls (one response per stream every TICK_MS, as a router relays a
decode worker's steps): grpc.aio accepts calls one per event-loop turn. Prints JSON.

    python scripts/bench_host_floors.py
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import zmq

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

ROUND_TRIPS = 3000
CALLS = 2000
PAUSE_S = 0.0005
"""Between requests, so the other side goes idle as it would between a client's calls."""


def percentiles_us(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    q = {"p50_us": 0.5, "p90_us": 0.9, "p99_us": 0.99}
    return {name: times[int(f * (len(times) - 1))] * 1e6 for name, f in q.items()}


def echo(inbox: str, outbox: str, spin: bool) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(inbox)
    push.connect(outbox)
    while True:
        if pull.poll(0 if spin else 1000):
            frame = pull.recv()
            if frame == b"stop":
                return
            push.send(frame)


def zmq_round_trip(spin: bool) -> dict[str, float]:
    inbox, outbox = f"ipc:///tmp/pdserve-floor-in-{spin}", f"ipc:///tmp/pdserve-floor-out-{spin}"
    peer = mp.Process(target=echo, args=(inbox, outbox, spin))
    peer.start()
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.connect(inbox)
    pull.bind(outbox)
    time.sleep(0.5)
    times = []
    for _ in range(ROUND_TRIPS):
        start = time.perf_counter()
        push.send(b"x" * 4000)  # NOTE: about a 1000-token GenerateCmd
        while not pull.poll(0 if spin else 1000):
            pass
        pull.recv()
        times.append(time.perf_counter() - start)
        time.sleep(PAUSE_S)
    push.send(b"stop")
    peer.join()
    return percentiles_us(times)


class Immediate(pb_grpc.GenerationServicer):
    async def Generate(self, request: pb.GenerateRequest, context: object) -> AsyncIterator[pb.GenerateResponse]:
        usage = pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=1)
        yield pb.GenerateResponse(token_ids=[1], text="x", finish_reason=pb.FINISH_REASON_LENGTH, usage=usage)


def serve(port: int, ticking: bool = False) -> None:
    """A grpc.aio server of Immediate, or of Ticking (with its ticker running)."""
    import grpc

    async def run() -> None:
        server = grpc.aio.server()
        servicer = Ticking() if ticking else Immediate()
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ticker = asyncio.create_task(servicer.ticker()) if isinstance(servicer, Ticking) else None
        await server.wait_for_termination()
        if ticker is not None:
            ticker.cancel()

    asyncio.run(run())


def grpc_floor(port: int = 50097) -> dict[str, float]:
    import grpc

    server = mp.Process(target=serve, args=(port,), daemon=True)
    server.start()
    time.sleep(2)

    async def calls() -> list[float]:
        times = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1000))))
            for _ in range(CALLS):
                start = time.perf_counter()
                async for _response in stub.Generate(request):
                    times.append(time.perf_counter() - start)
                await asyncio.sleep(PAUSE_S)
        return times[100:]  # NOTE: the first calls open the channel

    times = asyncio.run(calls())
    server.terminate()
    return percentiles_us(times)


TICK_MS = 2.0
"""The streaming server's step: every stream gets one response per tick (a decode step of the 1B bench shape)."""
STREAM_TOKENS = 256
STREAM_SECONDS = 8.0


class Ticking(pb_grpc.GenerationServicer):
    """Every call streams max_tokens responses, one per tick; the first carries the handler's start time (perf_counter,
    one clock for every process on the host) as its text."""

    def __init__(self) -> None:
        self.tick = asyncio.Condition()

    async def ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_MS / 1e3)
            async with self.tick:
                self.tick.notify_all()

    async def Generate(  # noqa: N802 - the gRPC method's name
        self, request: pb.GenerateRequest, context: object
    ) -> AsyncIterator[pb.GenerateResponse]:
        started = time.perf_counter()
        for i in range(request.sampling.max_tokens):
            async with self.tick:
                await self.tick.wait()
            yield pb.GenerateResponse(token_ids=[i], text=repr(started) if i == 0 else " x")


def _accept_client(port: int, streams: int) -> tuple[list[float], list[float]]:
    """Closed-loop streams for STREAM_SECONDS: (call -> handler start, handler start -> first response) per call."""
    import grpc

    async def run() -> tuple[list[float], list[float]]:
        accept: list[float] = []
        first: list[float] = []
        end = time.perf_counter() + STREAM_SECONDS
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            sampling = pb.SamplingParams(max_tokens=STREAM_TOKENS)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(32))), sampling=sampling)

            async def stream() -> None:
                while time.perf_counter() < end:
                    sent, seen = time.perf_counter(), False
                    async for response in stub.Generate(request):
                        if not seen:
                            started = float(response.text)
                            accept.append(started - sent)
                            first.append(time.perf_counter() - started)
                            seen = True

            await asyncio.gather(*(stream() for _ in range(streams)))
        return accept, first

    return asyncio.run(run())


def accept_under_streaming(streams: int, processes: int = 2, port: int = 50098) -> dict[str, dict[str, float]]:
    """Call -> handler start and handler -> first response at the client, `streams` closed-loop streams."""
    server = mp.Process(target=serve, args=(port, True), daemon=True)
    server.start()
    time.sleep(2)
    with mp.get_context("spawn").Pool(processes) as pool:
        parts = pool.starmap(_accept_client, [(port, streams // processes)] * processes)
    server.terminate()
    accept = [t for a, _ in parts for t in a]
    first = [t for _, f in parts for t in f]
    return {"call_to_handler": percentiles_us(accept), "handler_to_first_response": percentiles_us(first)}


def main() -> None:
    result = {
        "zmq_ipc_round_trip_blocking": zmq_round_trip(spin=False),
        "zmq_ipc_round_trip_spinning": zmq_round_trip(spin=True),
        "grpc_aio_generate_floor": grpc_floor(),
        "grpc_aio_accept_16_streams": accept_under_streaming(16),
        "grpc_aio_accept_64_streams": accept_under_streaming(64),
        "cpu": Path("/proc/cpuinfo").read_text().split("model name", 1)[-1].split("\n", 1)[0].strip(" :\t"),
        "num_cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
