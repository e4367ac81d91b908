#!/usr/bin/env python3
"""Host latency floors under pdserve's exact-hit TTFT, on this machine: a ZeroMQ ipc round trip between two
processes (blocking poll vs spinning) and a Python grpc.aio Generate that answers at once (1000 token ids in, one
response out), called like `pdserve-bench-serving` calls the router. Prints JSON.

    python scripts/bench_host_floors.py
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proto.pdserve.v1 import pdserve_pb2 as pb  # noqa: E402
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc  # noqa: E402

ROUND_TRIPS = 3000
CALLS = 2000
PAUSE_S = 0.0005
"""Between requests, so the other side goes idle as it would between a client's calls."""


def percentiles_us(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"p50_us": times[len(times) // 2] * 1e6, "p90_us": times[len(times) * 9 // 10] * 1e6}


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


def serve(port: int) -> None:
    import grpc

    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(Immediate(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

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


def main() -> None:
    result = {
        "zmq_ipc_round_trip_blocking": zmq_round_trip(spin=False),
        "zmq_ipc_round_trip_spinning": zmq_round_trip(spin=True),
        "grpc_aio_generate_floor": grpc_floor(),
        "cpu": Path("/proc/cpuinfo").read_text().split("model name", 1)[-1].split("\n", 1)[0].strip(" :\t"),
        "num_cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
