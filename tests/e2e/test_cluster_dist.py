"""The cross-host transport end to end on CPU: router + prefill + decode processes with --transport dist, the
KV blocks crossing over gloo point-to-point between the two worker processes; greedy tokens equal
transformers `generate`, every block comes back, a decode restart reconnects."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import NEW_TOKENS, generate_all, serves, tokens_of, wait_blocks_returned
from tests.hf_reference import hf_greedy, random_prompts


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    flags = ("--num-blocks", "256", "--transport", "dist")
    with running(tiny_llama_dir, tmp_path_factory.mktemp("run"), 1, 1, *flags) as c:
        yield c


def test_dist_transport_cluster_matches_transformers(cluster: Cluster, tiny_llama_dir: Path) -> None:
    prompts = random_prompts(1024, [1 + 11 * i for i in range(12)], seed=81)
    got = [tokens_of(r) for r in asyncio.run(generate_all(cluster.address, prompts))]
    assert got == hf_greedy(tiny_llama_dir, prompts, NEW_TOKENS)
    wait_blocks_returned(cluster)
    assert cluster.stats("decode", 0)["counters"]["blocks_pulled"] > 0
    assert cluster.stats("prefill", 0)["counters"]["leased_blocks"] == 0
    assert "KV transport dist" in (cluster.run_dir / "logs" / "decode-0.log").read_text()


def test_a_restarted_decode_worker_reconnects(cluster: Cluster) -> None:
    os.kill(cluster.pid("decode-0"), signal.SIGKILL)
    cluster.wait_for(lambda: cluster.status()["roles"][2]["restarts"] >= 1, 15.0, "decode-0 restarted")
    cluster.wait_for(lambda: serves(cluster), 20.0, "a request through the new decode worker")
    wait_blocks_returned(cluster)
