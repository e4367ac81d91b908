"""Graceful drain end to end: SIGTERM to the supervisor while 8 streams are decoding on a real cluster (router +
1 prefill + 1 decode on CPU). Every stream in flight finishes normally (LENGTH, all its tokens) within the router's
grace; once the router refuses, a new call gets UNAVAILABLE; the supervisor exits 0 within grace + a margin.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import greedy_request, tokens_of
from tests.hf_reference import random_prompts
from tests.models import TINY_LLAMA_VOCAB_SIZE
from tests.reliability.report import record

GRACE_S = 10.0
EXIT_MARGIN_S = 5.0
"""The supervisor exits within the router's grace plus this (workers stop after the router)."""
CLUSTER_FLAGS = ("--num-blocks", "256", "--grace", str(GRACE_S))
NUM_STREAMS = 8
MAX_TOKENS = 64
NUM_REFUSED_PROBES = 3
"""New calls made after the first refusal; each must be UNAVAILABLE too."""
PROBE_TIMEOUT_S = 5.0
SCENARIO = "graceful drain (SIGTERM)"


class Outcome(NamedTuple):
    code: grpc.StatusCode
    responses: list[pb.GenerateResponse]
    finished_at: float


@pytest.fixture
def cluster(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[Cluster]:
    """A cluster of its own: the test stops it."""
    with running(tiny_llama_dir, tmp_path / "run", 1, 1, *CLUSTER_FLAGS) as c:
        yield c


async def read_stream(call: grpc.aio.UnaryStreamCall, first: asyncio.Event) -> Outcome:
    responses: list[pb.GenerateResponse] = []
    try:
        async for response in call:
            responses.append(response)
            first.set()
    except grpc.aio.AioRpcError:
        pass
    first.set()  # NOTE: a stream that failed before its first response must not hang the test
    return Outcome(await call.code(), responses, time.monotonic())


def is_complete(outcome: Outcome, max_tokens: int) -> bool:
    last = outcome.responses[-1] if outcome.responses else None
    return (
        outcome.code == grpc.StatusCode.OK
        and last is not None
        and last.finish_reason == pb.FINISH_REASON_LENGTH
        and len(tokens_of(outcome.responses)) == max_tokens
    )


async def health_serving(address: str) -> bool:
    """The router's health says SERVING (False once it is NOT_SERVING or refuses the call)."""
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
    except grpc.aio.AioRpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def probe(address: str) -> grpc.StatusCode:
    """One new call on a fresh channel; OK only if it also streamed to a normal end."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(greedy_request([4, 5, 6], 3), timeout=PROBE_TIMEOUT_S)
        outcome = await read_stream(call, asyncio.Event())
    return outcome.code if outcome.code != grpc.StatusCode.OK or is_complete(outcome, 3) else grpc.StatusCode.UNKNOWN


async def wait_refused(address: str) -> tuple[int, list[grpc.StatusCode]]:
    """Until a new call is refused (bounded by the grace): the calls still accepted before that (each must
    complete), then NUM_REFUSED_PROBES more new calls' codes."""
    deadline = time.monotonic() + GRACE_S
    while await health_serving(address) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    num_failed_accepted = 0
    while time.monotonic() < deadline:
        code = await probe(address)
        if code == grpc.StatusCode.UNAVAILABLE:
            break
        num_failed_accepted += code != grpc.StatusCode.OK
    else:
        raise AssertionError(f"no new call was refused within {GRACE_S}s of SIGTERM")
    return num_failed_accepted, [await probe(address) for _ in range(NUM_REFUSED_PROBES)]


async def drain(cluster: Cluster, prompts: list[list[int]]) -> tuple[list[Outcome], int, list[grpc.StatusCode], float]:
    """Start the streams, SIGTERM the supervisor once each has a response; (outcomes, accepted probe
    failures, refused probe codes, SIGTERM time)."""
    async with grpc.aio.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        firsts = [asyncio.Event() for _ in prompts]
        calls = [stub.Generate(greedy_request(p, MAX_TOKENS), timeout=GRACE_S * 4) for p in prompts]
        tasks = [asyncio.create_task(read_stream(c, f)) for c, f in zip(calls, firsts, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), timeout=60.0)
        num_running = sum(not t.done() for t in tasks)
        assert num_running == len(prompts), f"only {num_running} streams still running at SIGTERM"
        sigterm_at = time.monotonic()
        cluster.proc.send_signal(signal.SIGTERM)
        num_failed_accepted, refused = await wait_refused(cluster.address)
        outcomes = await asyncio.gather(*tasks)
    return outcomes, num_failed_accepted, refused, sigterm_at


def test_sigterm_finishes_streams_in_flight_and_refuses_new_calls(cluster: Cluster) -> None:
    prompts = random_prompts(TINY_LLAMA_VOCAB_SIZE, [20 + 10 * i for i in range(NUM_STREAMS)], seed=11)
    outcomes, num_failed_accepted, refused, sigterm_at = asyncio.run(drain(cluster, prompts))
    drain_s = max(o.finished_at for o in outcomes) - sigterm_at
    code = cluster.proc.wait(timeout=GRACE_S + EXIT_MARGIN_S)
    exit_s = time.monotonic() - sigterm_at
    incomplete = [(o.code.name, len(tokens_of(o.responses))) for o in outcomes if not is_complete(o, MAX_TOKENS)]
    not_refused = [c.name for c in refused if c != grpc.StatusCode.UNAVAILABLE]
    failures = len(incomplete) + num_failed_accepted + len(not_refused)
    record(SCENARIO, len(outcomes) + len(refused), failures, 0, drain_s)
    print(f"drain {drain_s:.2f}s, supervisor exit {exit_s:.2f}s after SIGTERM (code {code})")
    assert not incomplete, f"streams in flight did not finish: {incomplete}\n{cluster.logs()}"
    assert num_failed_accepted == 0
    assert not not_refused, not_refused
    assert drain_s <= GRACE_S, drain_s
    assert code == 0, "".join(cluster.output)
    assert exit_s <= GRACE_S + EXIT_MARGIN_S, exit_s
