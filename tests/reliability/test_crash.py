"""Worker crashes under load with request migration (on by default, 2 retries): kill -9 a decode worker, and
separately a prefill worker, while 100 streams run on a real CPU cluster (router + 2 prefill + 2 decode).

Every stream finishes normally with exactly the greedy tokens the same cluster gave before the crash (those
of the dead worker resume elsewhere as prompt + tokens so far: nothing lost, nothing twice); the worker is
back (its new process heartbeats) within 10 s; every KV block is back in every pool and no lease is left; the
next 100 requests all succeed. (Migration off, 1 decode worker: tests/e2e/test_cluster.py
test_decode_crash_fails_streams_and_recovers — every stream ends UNAVAILABLE within 5 s.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import greedy_request, wait_blocks_returned
from tests.hf_reference import random_prompts
from tests.models import TINY_LLAMA_VOCAB_SIZE
from tests.reliability.report import record

NUM_PREFILL = NUM_DECODE = 2
CLUSTER_FLAGS = ("--num-blocks", "1024")
NUM_STREAMS = 100
BACK_WITHIN_S = 10.0
CALL_TIMEOUT_S = 120.0


class Workload(NamedTuple):
    prompts: list[list[int]]
    max_tokens: int


DECODE_LOAD = Workload(random_prompts(TINY_LLAMA_VOCAB_SIZE, [8 + (i * 7) % 40 for i in range(NUM_STREAMS)], 61), 96)
"""Short prompts, long outputs: the kill lands while every stream is decoding."""
PREFILL_LOAD = Workload(
    random_prompts(TINY_LLAMA_VOCAB_SIZE, [200 + (i * 37) % 300 for i in range(NUM_STREAMS)], 62), 8
)
"""Long prompts, short outputs: the kill lands while most prompts are queued or prefilling."""


class Outcome(NamedTuple):
    tokens: list[int]
    error: str | None


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running(tiny_llama_dir, tmp_path_factory.mktemp("run"), NUM_PREFILL, NUM_DECODE, *CLUSTER_FLAGS) as c:
        yield c


async def one(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest, progress: list[int], i: int) -> Outcome:
    tokens: list[int] = []
    try:
        async for response in stub.Generate(req, timeout=CALL_TIMEOUT_S):
            tokens += response.token_ids
            progress[i] = len(tokens)
    except grpc.aio.AioRpcError as exc:
        return Outcome(tokens, f"{exc.code().name}: {exc.details()}")
    return Outcome(tokens, None)


async def run_load(
    address: str, load: Workload, kill: Callable[[list[int]], bool] | None = None, tag: str = "load"
) -> tuple[list[Outcome], float | None]:
    """All streams of load at once, stream i as request {tag}-{i} (the workers' logs name it); kill(progress) is
    polled until it says it acted. (outcomes, kill time)"""
    progress = [0] * len(load.prompts)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        reqs = [greedy_request(p, load.max_tokens) for p in load.prompts]
        for i, req in enumerate(reqs):
            req.request_id = f"{tag}-{i}"
        tasks = [asyncio.create_task(one(stub, r, progress, i)) for i, r in enumerate(reqs)]
        killed_at = None
        while kill is not None and killed_at is None and not all(t.done() for t in tasks):
            if kill(progress):
                killed_at = time.monotonic()
            await asyncio.sleep(0.005)
        return list(await asyncio.gather(*tasks)), killed_at


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where a and b differ (the shorter one's length if one is a prefix of the other)."""
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def differences(outcomes: list[Outcome], reference: list[Outcome]) -> list[str]:
    """One line per stream that differs from its reference: index, first differing token, error."""
    lines = []
    for i, (o, r) in enumerate(zip(outcomes, reference, strict=True)):
        if o.tokens != r.tokens or o.error:
            at = first_difference(o.tokens, r.tokens)
            got, want = o.tokens[at : at + 3], r.tokens[at : at + 3]
            lines.append(
                f"stream {i}: {len(o.tokens)} tokens, first differs at {at} ({got} vs {want}), error {o.error}"
            )
    return lines


def incarnation(cluster: Cluster, role: str, worker: int) -> str:
    return str(cluster.stats(role, worker)["incarnation"])


def all_leases_free(cluster: Cluster) -> bool:
    return all(cluster.stats("prefill", i)["counters"]["leased_blocks"] == 0 for i in range(NUM_PREFILL))


def crash_under_load(cluster: Cluster, role: str, load: Workload, ready: Callable[[list[int]], bool]) -> None:
    """The scenario: reference run, the same load with a kill -9 of {role}-0 once ready(progress), checks."""
    reference, _ = asyncio.run(run_load(cluster.address, load, tag=f"{role}-reference"))
    assert all(o.error is None and len(o.tokens) == load.max_tokens for o in reference), reference
    old = incarnation(cluster, role, 0)
    pid = cluster.pid(f"{role}-0")

    back_at: list[float] = []

    def watch_restart() -> None:
        cluster.wait_for(lambda: incarnation(cluster, role, 0) != old, BACK_WITHIN_S + 5, f"{role}-0 back")
        back_at.append(time.monotonic())

    def kill(progress: list[int]) -> bool:
        if not ready(progress):
            return False
        os.kill(pid, signal.SIGKILL)
        threading.Thread(target=watch_restart, daemon=True).start()
        return True

    outcomes, killed_at = asyncio.run(run_load(cluster.address, load, kill, tag=f"{role}-kill"))
    assert killed_at is not None, "every stream finished before the kill"
    cluster.wait_for(lambda: bool(back_at), BACK_WITHIN_S + 5, f"{role}-0 back")
    back_s = back_at[0] - killed_at
    wrong = differences(outcomes, reference)
    leaked = 0
    try:
        wait_blocks_returned(cluster, NUM_PREFILL, NUM_DECODE, timeout=10.0)
        cluster.wait_for(lambda: all_leases_free(cluster), 5.0, "no lease left")
    except AssertionError:
        stats = [cluster.stats(r, i) for r in ("prefill", "decode") for i in range(2)]
        leaked = sum(s["num_total_blocks"] - s["num_free_blocks"] for s in stats)
    after, _ = asyncio.run(run_load(cluster.address, load, tag=f"{role}-after"))
    failed_after = sum(o.error is not None or o.tokens != r.tokens for o, r in zip(after, reference, strict=True))
    router_log = (cluster.run_dir / "logs" / "router.log").read_text(errors="replace")
    migrated = router_log.count("; migrated with")
    record(f"kill -9 {role} worker, 100 streams (migration)", NUM_STREAMS, len(wrong), leaked, back_s)
    record(f"100 requests after the {role} worker restart", NUM_STREAMS, failed_after, 0, None)
    print(f"{role}: {migrated} migrations so far, back {back_s:.2f} s after the kill; {len(wrong)} wrong streams")
    assert not wrong, "\n".join([f"logs: {cluster.run_dir / 'logs'}", *wrong[:10]])
    assert migrated > 0, router_log[-2000:]
    assert back_s <= BACK_WITHIN_S and leaked == 0 and failed_after == 0


def test_kill_decode_worker_under_100_streams_migrates_them(cluster: Cluster) -> None:
    # NOTE: kill once every stream is past its first (prefill) token: half of them are on decode-0
    crash_under_load(cluster, "decode", DECODE_LOAD, lambda progress: min(progress) >= 2)


def test_kill_prefill_worker_under_100_streams_migrates_them(cluster: Cluster) -> None:
    # NOTE: kill once a tenth of the prompts are done: the rest are queued or prefilling on both workers
    crash_under_load(cluster, "prefill", PREFILL_LOAD, lambda progress: sum(p > 0 for p in progress) >= 10)
