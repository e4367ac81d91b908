"""Prefix-aware routing and conditional disaggregation with real processes: 2 prefill + 2 decode workers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import greedy_request, stream, tokens_of, wait_blocks_returned
from tests.hf_reference import hf_greedy, random_prompts

EVENTS_S = 2.0
"""Long enough for a worker's KV events to reach the router and two heartbeats to refresh the stats files, on a
loaded 2-core CI machine too (0.6 s once left a second turn routed to a prefill worker there)."""


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    flags = ("--num-blocks", "256", "--conditional-disagg")
    with running(tiny_llama_dir, tmp_path_factory.mktemp("run"), 2, 2, *flags) as c:
        yield c


def prefill_tokens(cluster: Cluster) -> list[int]:
    return [cluster.stats("prefill", i)["counters"]["prefill_tokens_computed"] for i in range(2)]


def test_shared_prefix_lands_on_the_prefill_worker_that_holds_it(cluster: Cluster, tiny_llama_dir: Path) -> None:
    prefix, *suffixes = random_prompts(1024, (64, 80, 80, 80, 80), seed=41)  # suffixes > the local threshold
    before = prefill_tokens(cluster)
    asyncio.run(stream(cluster.address, greedy_request(prefix, max_tokens=2)))
    time.sleep(EVENTS_S)
    first = prefill_tokens(cluster)
    holder = next(i for i in range(2) if first[i] - before[i] == len(prefix))
    prompts = [prefix + s for s in suffixes]
    for prompt in prompts:  # NOTE: one at a time, so no queue makes the other worker cheaper
        responses = asyncio.run(stream(cluster.address, greedy_request(prompt, max_tokens=4)))
        assert responses[-1].usage.cached_prompt_tokens == len(prefix)
    time.sleep(EVENTS_S)
    after = prefill_tokens(cluster)
    assert after[holder] - first[holder] == sum(len(s) for s in suffixes)  # the prefix was never recomputed
    assert after[1 - holder] == first[1 - holder]
    wait_blocks_returned(cluster, prefill=2, decode=2)


def test_a_second_turn_is_computed_by_the_decode_worker_holding_the_first(
    cluster: Cluster, tiny_llama_dir: Path
) -> None:
    (turn1,) = random_prompts(1024, (48,), seed=42)
    answer = tokens_of(asyncio.run(stream(cluster.address, greedy_request(turn1, max_tokens=16))))
    time.sleep(EVENTS_S)
    turn2 = [*turn1, *answer, *random_prompts(1024, (8,), seed=43)[0]]  # 72 tokens
    prefill_before = prefill_tokens(cluster)
    decode_before = [cluster.stats("decode", j)["counters"]["prefill_tokens_computed"] for j in range(2)]
    got = tokens_of(asyncio.run(stream(cluster.address, greedy_request(turn2, max_tokens=12))))
    assert got == hf_greedy(tiny_llama_dir, [turn2], 12)[0]
    time.sleep(EVENTS_S)
    assert prefill_tokens(cluster) == prefill_before  # no prefill worker took part
    decode_after = [cluster.stats("decode", j)["counters"]["prefill_tokens_computed"] for j in range(2)]
    idle, local = sorted(a - b for a, b in zip(decode_after, decode_before, strict=True))
    # NOTE: 3 or 4 blocks cached: an overlapped decode step may have written the last answer token's KV too
    assert idle == 0 and local in (len(turn2) - 48, len(turn2) - 64)
    wait_blocks_returned(cluster, prefill=2, decode=2)
