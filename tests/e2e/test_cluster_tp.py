"""Workers as TP groups on CPU (gloo): prefill and decode groups of equal and of different TP sizes (head-sliced KV
handoffs), and colocated TP, give transformers' greedy tokens; a killed rank > 0 takes its group down and the
supervisor brings the whole group back with no block lost."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.cluster import Cluster
from tests.e2e.test_cluster import generate_all, greedy_request, tokens_of
from tests.e2e.test_cluster import wait_blocks_returned as wait_all_blocks
from tests.hf_reference import hf_greedy, random_prompts

NEW_TOKENS = 16
SHAPES = {
    # name: (model fixture, prefill workers, launcher flags, prefill TP, decode TP)
    "tiny-p2d2": ("tiny_llama_dir", 1, ("--prefill-tp", "2", "--decode-tp", "2"), 2, 2),
    "smollm2-p3d1": ("smollm2_dir", 1, ("--prefill-tp", "3"), 3, 1),
    "smollm2-p1d3": ("smollm2_dir", 1, ("--decode-tp", "3"), 1, 3),
    "tiny-colocated-tp2": ("tiny_llama_dir", 0, ("--colocated", "--tp", "2"), 0, 2),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    fixture, prefill, flags, _, _ = SHAPES[request.param]
    model_dir = request.getfixturevalue(fixture)
    cluster = Cluster(model_dir, tmp_path_factory.mktemp("run"), max(prefill, 1), 1, "--num-blocks", "256", *flags)
    try:
        cluster.wait_ready(timeout=240.0)
        yield cluster, request.param
    finally:
        cluster.stop()


def _vocab(model_dir: Path) -> int:
    return 1024 if "tiny" in str(model_dir) else 49152


def test_streams_match_hf(shaped: tuple[Cluster, str], request: pytest.FixtureRequest) -> None:
    cluster, name = shaped
    fixture, prefill, _, prefill_tp, decode_tp = SHAPES[name]
    model_dir = request.getfixturevalue(fixture)
    prompts = random_prompts(_vocab(model_dir), [2 + 9 * i for i in range(8)], seed=61)  # up to 65 tokens: 5 blocks
    got = [tokens_of(r) for r in asyncio.run(generate_all(cluster.address, prompts, NEW_TOKENS))]
    assert got == hf_greedy(model_dir, prompts, NEW_TOKENS)
    wait_all_blocks(cluster, prefill, 1)
    decode = cluster.stats("decode", 0)
    assert len(decode["ranks"]) == (decode_tp if decode_tp > 1 else 0)
    assert decode["layout"]["tp_size"] == decode_tp
    if prefill:
        assert len(cluster.stats("prefill", 0)["ranks"]) == (prefill_tp if prefill_tp > 1 else 0)
        assert decode["counters"]["prefill_tokens_computed"] == 0 and decode["counters"]["blocks_pulled"] > 0


async def _stream_until_killed(cluster: Cluster, prompts: list[list[int]], victim: int) -> list[object]:
    """Stream every prompt; kill -9 pid `victim` once each stream has its second token."""

    async def one(prompt: list[int], second: asyncio.Event) -> list[int]:
        tokens: list[int] = []
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            async for response in pb_grpc.GenerationStub(channel).Generate(greedy_request(prompt, 300), timeout=60):
                tokens += response.token_ids
                if len(tokens) >= 2:
                    second.set()
        return tokens

    events = [asyncio.Event() for _ in prompts]
    tasks = [asyncio.create_task(one(p, e)) for p, e in zip(prompts, events, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
    os.kill(victim, signal.SIGKILL)
    return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("shaped", ["tiny-p2d2"], indirect=True)
def test_killed_decode_rank_takes_its_group_down_and_back(shaped: tuple[Cluster, str], tiny_llama_dir: Path) -> None:
    """kill -9 of rank 1 of decode-0 mid-stream: rank 0 exits with it, every stream ends UNAVAILABLE or finishes
    with transformers' tokens (migrated), the supervisor starts the whole group again (new pids for both ranks),
    the prefill worker gets its leases back, and the group serves the same tokens as before. Last in this file."""
    cluster, _ = shaped
    before = cluster.stats("decode", 0)
    leader, rank1 = before["ranks"]
    prompts = random_prompts(1024, (20, 33, 41), seed=62)
    killed = time.monotonic()
    results = asyncio.run(_stream_until_killed(cluster, prompts, rank1))
    reference = hf_greedy(tiny_llama_dir, prompts, 300)
    for result, expected in zip(results, reference, strict=True):
        if isinstance(result, grpc.aio.AioRpcError):
            assert result.code() == grpc.StatusCode.UNAVAILABLE, result
        else:
            assert result == expected
    assert time.monotonic() - killed < 60
    cluster.wait_for(lambda: cluster.stats("decode", 0)["incarnation"] != before["incarnation"], 60.0, "decode-0 back")
    after = cluster.stats("decode", 0)["ranks"]
    assert len(after) == 2 and not {leader, rank1} & set(after)
    assert not _alive(leader) and not _alive(rank1)
    cluster.wait_for(lambda: cluster.stats("prefill", 0)["counters"]["leased_blocks"] == 0, 10.0, "leases reclaimed")

    def serves() -> bool:
        try:
            got = [tokens_of(r) for r in asyncio.run(generate_all(cluster.address, prompts[:1], NEW_TOKENS))]
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return False
        assert got == [reference[0][:NEW_TOKENS]]
        return True

    cluster.wait_for(serves, 30.0, "the restarted group to serve")
    wait_all_blocks(cluster, 1, 1, timeout=10.0)
    # kill -9 of rank 0 (the process the supervisor knows): its rank 1 dies with it, never left running
    second = cluster.stats("decode", 0)
    os.kill(second["ranks"][0], signal.SIGKILL)
    cluster.wait_for(lambda: not _alive(second["ranks"][1]), 10.0, "rank 1 gone with its rank 0")
    cluster.wait_for(lambda: cluster.stats("decode", 0)["incarnation"] != second["incarnation"], 60.0, "back again")
    cluster.wait_for(serves, 30.0, "the group to serve again")


def _alive(pid: int) -> bool:
    """pid runs (a zombie, exited but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
