"""Several front ends on one port (pdserve-cluster --frontends 2): the kernel spreads gRPC and HTTP connections
over two router processes; every stream gets transformers' greedy tokens from whichever serves it, both serve
some, and every KV block and load count is back afterwards. A front end killed with SIGKILL loses only its own
streams: the other keeps serving, the workers abort the lost ones (their blocks free), the supervisor brings it
back with a zeroed row of the shared load counts."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai
import pytest

from pdserve.core.lifecycle import READY_MARK
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.cluster import Cluster, free_port, running
from tests.e2e.test_cluster import NEW_TOKENS, WORKER_FLAGS, greedy_request, tokens_of
from tests.e2e.test_cluster import wait_blocks_returned as blocks_back
from tests.e2e.test_metrics import scrape, value
from tests.hf_reference import hf_greedy, random_prompts

ROUTERS = ("router-0", "router-1")
LONG_TOKENS = 120
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""A channel with a connection of its own: channels of one process to one address share one otherwise, and the
kernel spreads connections, not calls, over the front ends."""


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # NOTE: front ends share fixed ports: the HTTP one too (the helper's --http-port 0 is overridden)
    flags = ("--frontends", "2", "--http-port", str(free_port()), *WORKER_FLAGS)
    with running(tiny_llama_dir, tmp_path_factory.mktemp("run"), 1, 1, *flags) as c:
        yield c


def ok_calls(cluster: Cluster, name: str) -> float:
    return value(scrape(cluster, name), "pdserve_requests_total", outcome="ok")


def load_counts(cluster: Cluster) -> np.ndarray:
    """The shared load table: [front ends, counters, slots] (router/load_table.py)."""
    (path,) = cluster.run_dir.glob("frontend-loads-*")
    return np.fromfile(path, dtype=np.int64).reshape(2, 4, -1)


def http_completion(url: str, prompt: list[int]) -> Any:
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = sdk.models.list().data[0].id
    return sdk.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True}
    )


def test_grpc_and_http_on_one_port_reach_both_front_ends_with_greedy_tokens(
    cluster: Cluster, tiny_llama_dir: Path
) -> None:
    prompts = random_prompts(1024, [3 + 5 * i for i in range(24)], seed=61)
    http_prompts = prompts[:8]
    before = {name: ok_calls(cluster, name) for name in ROUTERS}

    async def everything() -> tuple[list[list[pb.GenerateResponse]], list[Any]]:
        streams = _all(cluster, prompts)
        http = asyncio.gather(*(asyncio.to_thread(http_completion, cluster.http_url, p) for p in http_prompts))
        return await asyncio.gather(streams, http)  # type: ignore[return-value]

    grpc_results, http_results = asyncio.run(everything())
    got = [tokens_of(r) for r in grpc_results]
    assert got == hf_greedy(tiny_llama_dir, prompts, NEW_TOKENS)
    grpc_texts = ["".join(r.text for r in responses) for responses in grpc_results[: len(http_prompts)]]
    assert [c.choices[0].text for c in http_results] == grpc_texts
    assert all(c.usage.completion_tokens == NEW_TOKENS for c in http_results)
    served = {name: ok_calls(cluster, name) - before[name] for name in ROUTERS}
    assert sum(served.values()) == len(prompts) + len(http_prompts) and all(served.values()), served
    blocks_back(cluster)
    assert not load_counts(cluster).any()


def test_a_killed_front_end_loses_only_its_streams_and_comes_back_with_nothing_leaked(
    cluster: Cluster, tiny_llama_dir: Path
) -> None:
    prompts = random_prompts(1024, [10 + 3 * i for i in range(16)], seed=62)
    killed_pid = cluster.pid("router-1")

    async def one(prompt: list[int], started: asyncio.Event) -> list[int] | grpc.aio.AioRpcError:
        tokens: list[int] = []
        try:
            async with grpc.aio.insecure_channel(cluster.address, OWN_CONNECTION) as channel:
                async for r in pb_grpc.GenerationStub(channel).Generate(greedy_request(prompt, LONG_TOKENS)):
                    tokens += r.token_ids
                    started.set()
        except grpc.aio.AioRpcError as exc:
            started.set()
            return exc
        return tokens

    async def run_and_kill() -> list[list[int] | grpc.aio.AioRpcError]:
        events = [asyncio.Event() for _ in prompts]
        tasks = [asyncio.create_task(one(p, e)) for p, e in zip(prompts, events, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        os.kill(killed_pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)

    results = asyncio.run(run_and_kill())
    lost = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert all(r.code() == grpc.StatusCode.UNAVAILABLE for r in lost), lost
    done = [(p, r) for p, r in zip(prompts, results, strict=True) if not isinstance(r, grpc.aio.AioRpcError)]
    assert lost and done, f"{len(lost)} streams lost, {len(done)} done: each front end should have held some"
    assert [r for _, r in done] == hf_greedy(tiny_llama_dir, [p for p, _ in done], LONG_TOKENS)
    small = greedy_request([4, 5, 6], max_tokens=3)
    for _ in range(4):  # the other front end serves meanwhile; a restarted router-1 listens only once it serves
        assert len(tokens_of(asyncio.run(own_stream(cluster.address, small)))) == 3
    blocks_back(cluster, timeout=10.0)  # NOTE: the decode worker aborted router-1's streams: long before their end

    def back() -> bool:
        role = next(r for r in cluster.status()["roles"] if r["name"] == "router-1")
        return role["restarts"] >= 1 and role["state"] == "running" and role["pid"] != killed_pid

    cluster.wait_for(back, 30.0, "router-1 restarted")
    log = cluster.run_dir / "logs" / "router-1.log"
    cluster.wait_for(lambda: log.read_text().count(READY_MARK) == 2, 30.0, "router-1 ready again")
    before = ok_calls(cluster, "router-1")
    prompts = random_prompts(1024, [4 + i for i in range(16)], seed=63)
    got = asyncio.run(asyncio.wait_for(_all(cluster, prompts), 120))
    assert [tokens_of(r) for r in got] == hf_greedy(tiny_llama_dir, prompts, NEW_TOKENS)
    assert ok_calls(cluster, "router-1") > before  # the new router-1 serves its share
    blocks_back(cluster)
    assert not load_counts(cluster).any()


async def own_stream(address: str, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(address, OWN_CONNECTION) as channel:
        return [r async for r in pb_grpc.GenerationStub(channel).Generate(req)]


async def _all(cluster: Cluster, prompts: list[list[int]]) -> list[list[pb.GenerateResponse]]:
    return await asyncio.gather(*(own_stream(cluster.address, greedy_request(p)) for p in prompts))
