"""Qwen3, Qwen3-MoE and Mixtral (tiny random checkpoints made by transformers) through the cluster on CPU:
1 prefill + 1 decode process with the block handoff, chunked prefill forced and prefix caching on; greedy
streams equal transformers `generate` token for token (fp32)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.e2e.cluster import running
from tests.e2e.test_cluster import generate_all, tokens_of, wait_blocks_returned
from tests.hf_reference import hf_greedy, random_prompts

NEW_TOKENS = 32
FLAGS = ("--num-blocks", "256", "--prefill-chunk-size", "7", "--max-num-batched-tokens", "32")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral"])
def test_streams_through_prefill_handoff_decode_match_hf(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    prefix = random_prompts(1024, [37], seed=80)[0]  # two full 16-token blocks, cached by the first wave
    first = [prefix + t for t in random_prompts(1024, (2, 9), seed=81)]
    second = [prefix + t for t in random_prompts(1024, (5, 30), seed=82)] + random_prompts(1024, [4], seed=83)
    with running(model_dir, tmp_path, 1, 1, *FLAGS) as cluster:
        got = [tokens_of(r) for r in asyncio.run(generate_all(cluster.address, first, NEW_TOKENS))]
        got += [tokens_of(r) for r in asyncio.run(generate_all(cluster.address, second, NEW_TOKENS))]
        assert got == hf_greedy(model_dir, first + second, NEW_TOKENS)
        # NOTE: the stats file is the worker's last heartbeat (every 0.25 s, from a thread a loaded host may starve)
        cluster.wait_for(lambda: cluster.stats("prefill", 0)["counters"]["cached_prompt_tokens"] >= 2 * 32, 10.0,
                         "the second wave's two 32-token prefix hits in the prefill worker's stats")  # fmt: skip
        decode = cluster.stats("decode", 0)["counters"]
        assert decode["blocks_pulled"] > 0 and decode["prefill_tokens_computed"] == 0
        wait_blocks_returned(cluster)
