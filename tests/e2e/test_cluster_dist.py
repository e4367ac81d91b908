"""The cross-host transport end to end on CPU: router + prefill + decode processes with --transport dist, the
KV blocks crossing over gloo point-to-point between the two worker processes; greedy tokens equal
transformers `generate`, every block comes back, a decode restart reconnects. Between TP groups (prefill TP 2 ->
decode TP 1, TP 1 -> TP 2) each decode rank pulls its KV heads from the prefill ranks holding them, and under
--transport auto every rank of a prefill group exports both the host-local kind and dist."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import NEW_TOKENS, generate_all, serves, tokens_of, wait_blocks_returned
from tests.e2e.test_multi_host import free_base_port
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


TP_SHAPES = {"p2d1": (2, 1), "p1d2": (1, 2)}
"""name: (prefill TP, decode TP); the tiny llama's 2 KV heads: one per rank of a TP-2 group."""


@pytest.fixture(scope="module", params=list(TP_SHAPES))
def tp_cluster(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Cluster, str]]:
    prefill_tp, decode_tp = TP_SHAPES[request.param]
    tp = ("--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp))
    cluster = Cluster(
        tiny_llama_dir, tmp_path_factory.mktemp("run"), 1, 1, "--num-blocks", "256", "--transport", "dist", *tp
    )
    try:
        cluster.wait_ready(timeout=240.0)
        yield cluster, request.param
    finally:
        cluster.stop()


def test_dist_transport_between_tp_groups_matches_transformers(
    tp_cluster: tuple[Cluster, str], tiny_llama_dir: Path
) -> None:
    cluster, name = tp_cluster
    prefill_tp, decode_tp = TP_SHAPES[name]
    prompts = random_prompts(1024, [2 + 9 * i for i in range(8)], seed=83)  # up to 65 tokens: 5 blocks
    got = [tokens_of(r) for r in asyncio.run(generate_all(cluster.address, prompts))]
    assert got == hf_greedy(tiny_llama_dir, prompts, NEW_TOKENS)
    wait_blocks_returned(cluster)
    decode, prefill = cluster.stats("decode", 0), cluster.stats("prefill", 0)
    assert decode["layout"]["tp_size"] == decode_tp and prefill["layout"]["tp_size"] == prefill_tp
    assert [len(stats["ranks"]) for stats in (prefill, decode)] == [n if n > 1 else 0 for n in (prefill_tp, decode_tp)]
    assert decode["counters"]["prefill_tokens_computed"] == 0 and decode["counters"]["blocks_pulled"] > 0
    assert prefill["counters"]["leased_blocks"] == 0
    assert "KV transport dist with prefill worker 0" in (cluster.run_dir / "logs" / "decode-0.log").read_text()


def test_every_prefill_rank_exports_each_kind_of_its_pairs(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """--transport auto, prefill TP 2, decode-0 on the prefill worker's host (shm) and decode-1 on another
    (127.0.0.2, loopback here: dist): both pairs serve transformers' tokens from both prefill ranks' heads."""
    topology = tmp_path / "topology.json"
    hosts = {"router": "127.0.0.1", "prefill": ["127.0.0.1"], "decode": ["127.0.0.1", "127.0.0.2"]}
    topology.write_text(json.dumps({**hosts, "base_port": free_base_port()}))
    flags = ("--num-blocks", "256", "--prefill-tp", "2", "--topology", str(topology))
    cluster = Cluster(tiny_llama_dir, tmp_path / "run", 1, 2, *flags)
    try:
        cluster.wait_ready(timeout=240.0)
        prompts = random_prompts(1024, [3 + 11 * i for i in range(12)], seed=84)
        got = [tokens_of(r) for r in asyncio.run(generate_all(cluster.address, prompts))]
        assert got == hf_greedy(tiny_llama_dir, prompts, NEW_TOKENS)
        wait_blocks_returned(cluster, 1, 2)
        assert all(cluster.stats("decode", j)["counters"]["blocks_pulled"] > 0 for j in (0, 1))
        logs = cluster.run_dir / "logs"
        assert "KV transport shm with prefill worker 0" in (logs / "decode-0.log").read_text()
        assert "KV transport dist with prefill worker 0" in (logs / "decode-1.log").read_text()
    finally:
        cluster.stop()
