"""Overload: 2000 concurrent streams against a decode worker with KV room for 200 of them (router + 1 prefill +
1 decode on CPU). Admission control (router/admission.py) lets in what fits, queues up to --max-queued
(1024, the default) and refuses the rest with RESOURCE_EXHAUSTED at once. Every admitted request completes
with all its tokens, the decode worker never preempts, no process dies or restarts, every block comes back,
and the router's memory stays bounded.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import greedy_request, wait_blocks_returned
from tests.hf_reference import random_prompts
from tests.models import TINY_LLAMA_VOCAB_SIZE
from tests.reliability.report import record

NUM_STREAMS = 2000
ROOM_FOR = 200
PROMPT_TOKENS, MAX_TOKENS, BLOCK_SIZE = 8, 200, 16
"""Streams long enough that all 2000 calls arrive while the first 200 still decode (at 24 tokens the cluster,
one CPU thread per worker, finished them as fast as they came and refused none)."""
BLOCKS_PER_REQUEST = (PROMPT_TOKENS + MAX_TOKENS) // BLOCK_SIZE
MAX_QUEUED = 1024
CLUSTER_FLAGS = ("--num-blocks", str(ROOM_FOR * BLOCKS_PER_REQUEST + 1), "--max-queued", str(MAX_QUEUED))
"""+1: block 0 is the null block."""
ROUTER_RSS_LIMIT = 1 << 30
CALL_TIMEOUT_S = 300.0
SCENARIO = "overload: 2000 streams, KV room for 200"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running(tiny_llama_dir, tmp_path_factory.mktemp("run"), 1, 1, *CLUSTER_FLAGS) as c:
        yield c


async def one(stub: pb_grpc.GenerationStub, prompt: list[int]) -> str:
    """ok | the status code name | 'short: n' for a stream that ended OK with fewer tokens."""
    n = 0
    try:
        async for response in stub.Generate(greedy_request(prompt, MAX_TOKENS), timeout=CALL_TIMEOUT_S):
            n += len(response.token_ids)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name if exc.code() != grpc.StatusCode.CANCELLED else f"CANCELLED: {exc.details()} after {n}"
    return "ok" if n == MAX_TOKENS else f"short: {n}"


async def flood(address: str, prompts: list[list[int]]) -> list[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        return list(await asyncio.gather(*(one(stub, p) for p in prompts)))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_overload_admits_what_fits_queues_a_bounded_number_and_refuses_the_rest(cluster: Cluster) -> None:
    pids = {name: cluster.pid(name) for name in ("router", "prefill-0", "decode-0")}
    prompts = random_prompts(TINY_LLAMA_VOCAB_SIZE, [PROMPT_TOKENS] * NUM_STREAMS, seed=77)
    start = time.monotonic()
    outcomes = Counter(asyncio.run(flood(cluster.address, prompts)))
    took = time.monotonic() - start
    decode = cluster.stats("decode", 0)
    router_rss = rss_bytes(pids["router"])
    leaked = 0
    try:
        wait_blocks_returned(cluster, timeout=10.0)
    except AssertionError:
        leaked = decode["num_total_blocks"] - decode["num_free_blocks"]
    restarted = [
        r["name"] for r in cluster.status()["roles"] if r["restarts"] or cluster.pid(r["name"]) != pids[r["name"]]
    ]
    failures = sum(n for kind, n in outcomes.items() if kind not in ("ok", "RESOURCE_EXHAUSTED"))
    record(SCENARIO, NUM_STREAMS, failures + len(restarted), leaked, None)
    print(f"{dict(outcomes)} in {took:.1f} s; router RSS {router_rss >> 20} MiB; decode counters {decode['counters']}")
    assert failures == 0 and not restarted and leaked == 0, (outcomes, restarted)
    assert outcomes["ok"] >= ROOM_FOR + MAX_QUEUED and outcomes["RESOURCE_EXHAUSTED"] > 0, outcomes
    assert decode["counters"]["preemptions"] == 0
    assert router_rss < ROUTER_RSS_LIMIT
