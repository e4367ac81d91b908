"""Colocated mode (the benchmarks' baseline): router + a decode worker that prefills its own requests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import cancel_after, generate_all, stream, tokens_of
from tests.hf_reference import hf_greedy, random_prompts

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def colocated(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    flags = ("--colocated", "--num-blocks", "256", "--prefill-chunk-size", "32")
    with running(tiny_llama_dir, tmp_path_factory.mktemp("run"), 1, 1, *flags) as c:
        yield c


def blocks_back(cluster: Cluster) -> bool:
    s = cluster.stats("decode", 0)
    return bool(s["num_free_blocks"] == s["num_total_blocks"])


def test_colocated_streams_match_hf_with_chunked_prefill(colocated: Cluster, tiny_llama_dir: Path) -> None:
    prompts = random_prompts(1024, [5 + 13 * i for i in range(8)], seed=41)  # up to 96 tokens: 3 chunks
    results = asyncio.run(generate_all(colocated.address, prompts, NEW_TOKENS))
    assert [tokens_of(r) for r in results] == hf_greedy(tiny_llama_dir, prompts, NEW_TOKENS)
    for prompt, responses in zip(prompts, results, strict=True):
        last = responses[-1]
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), NEW_TOKENS)
        assert last.timings.first_token_ms > 0 and last.timings.prefill_ms > 0 and last.timings.handoff_ms == 0
    colocated.wait_for(lambda: blocks_back(colocated), 5.0, "every KV block back in the pool")
    counters = colocated.stats("decode", 0)["counters"]
    assert counters["prefill_tokens_computed"] >= sum(len(p) for p in prompts)
    assert counters["blocks_pulled"] == 0
    assert not (colocated.run_dir / "logs" / "prefill-0.log").exists()


def test_colocated_cancel_and_bad_input(colocated: Cluster) -> None:
    (prompt,) = random_prompts(1024, (40,), seed=42)
    assert asyncio.run(cancel_after(colocated.address, prompt, 3)) == 3
    colocated.wait_for(lambda: blocks_back(colocated), 1.0, "the cancelled request's blocks back")
    bad = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 5000]), sampling=pb.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(stream(colocated.address, bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
