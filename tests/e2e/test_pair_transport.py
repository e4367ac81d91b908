"""Per-pair KV transport (--transport auto, the default): with a topology that puts prefill-0 and decode-0 on
one host (127.0.0.1) and decode-1 on another (127.0.0.2, also loopback here), prefill-0 serves decode-0 over
shm and decode-1 over dist (gloo), each decode worker opening the sink its peer's descriptor names. Greedy
tokens equal transformers `generate`; both decode workers pulled blocks; every block comes back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.test_cluster import NEW_TOKENS, generate_all, tokens_of
from tests.e2e.test_multi_host import free_base_port
from tests.hf_reference import hf_greedy, random_prompts


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("pairs")
    topology = root / "topology.json"
    hosts = {"router": "127.0.0.1", "prefill": ["127.0.0.1"], "decode": ["127.0.0.1", "127.0.0.2"]}
    topology.write_text(json.dumps({**hosts, "base_port": free_base_port()}))
    c = Cluster(tiny_llama_dir, root / "run", 1, 2, "--num-blocks", "256", "--topology", str(topology))
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def log_of(cluster: Cluster, name: str) -> str:
    return (cluster.run_dir / "logs" / f"{name}.log").read_text()


def test_each_pair_takes_the_transport_of_its_hosts(cluster: Cluster, tiny_llama_dir: Path) -> None:
    prompts = random_prompts(1024, [3 + 11 * i for i in range(12)], seed=91)
    got = [tokens_of(r) for r in asyncio.run(generate_all(cluster.address, prompts))]
    assert got == hf_greedy(tiny_llama_dir, prompts, NEW_TOKENS)
    for j in (0, 1):
        cluster.wait_for(lambda j=j: cluster.stats("decode", j)["num_free_blocks"] == cluster.stats("decode", j)[
            "num_total_blocks"], 5.0, f"decode-{j} blocks back")  # fmt: skip
        assert cluster.stats("decode", j)["counters"]["blocks_pulled"] > 0, f"decode-{j} pulled nothing"
    assert "KV transport shm with prefill worker 0" in log_of(cluster, "decode-0")
    assert "KV transport dist with prefill worker 0" in log_of(cluster, "decode-1")
    prefill = log_of(cluster, "prefill-0")
    assert "KV transport shm opened" in prefill and "KV transport dist opened" in prefill
