"""Issue 6 on one GPU (cuda_ipc, 2 prefill + 1 decode): decode-side block sharing copies only new blocks, and a
second turn computed by the decode worker itself (conditional disaggregation) equals transformers in fp32."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.test_cluster import greedy_request, stream, tokens_of, wait_blocks_returned
from tests.hf_reference import random_prompts
from tests.kernels.test_engine_cuda import NEW_TOKENS, hf_greedy_cuda

pytestmark = pytest.mark.gpu


def test_shared_prefix_and_second_turn_on_gpu(tiny_llama_dir: Path, tmp_path: Path) -> None:
    flags = ("--num-blocks", "512", "--conditional-disagg")
    cluster = Cluster(tiny_llama_dir, tmp_path / "run", 2, 1, *flags, device="cuda")
    try:
        cluster.wait_ready()
        prefix, *suffixes = random_prompts(1024, (96, 70, 75, 80), seed=71)
        prompts = [prefix + s for s in suffixes]
        got = [tokens_of(asyncio.run(stream(cluster.address, greedy_request(p, NEW_TOKENS)))) for p in prompts]
        expected, _ = hf_greedy_cuda(tiny_llama_dir, prompts)
        assert got == expected
        time.sleep(0.6)
        decode = cluster.stats("decode", 0)["counters"]
        # the first handoff copies every block; the next two share the 6 prefix blocks and copy the rest
        assert decode["blocks_shared"] == 2 * (len(prefix) // 16)
        assert decode["blocks_pulled"] == sum(-(-len(p) // 16) for p in prompts) - decode["blocks_shared"]

        turn2 = [*prompts[0], *got[0], *random_prompts(1024, (10,), seed=72)[0]]
        before = [cluster.stats("prefill", i)["counters"]["forward_calls"] for i in range(2)]
        second = tokens_of(asyncio.run(stream(cluster.address, greedy_request(turn2, NEW_TOKENS))))
        assert second == hf_greedy_cuda(tiny_llama_dir, [turn2])[0][0]
        time.sleep(0.6)
        assert [cluster.stats("prefill", i)["counters"]["forward_calls"] for i in range(2)] == before
        assert cluster.stats("decode", 0)["counters"]["prefill_tokens_computed"] > 0
        wait_blocks_returned(cluster, prefill=2, decode=1)
    finally:
        cluster.stop()
