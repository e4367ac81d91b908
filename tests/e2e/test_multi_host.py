"""A cluster spread over "hosts": one supervisor per host (--topology, --roles), every socket between the
processes TCP (core/ipc.py Topology), the KV blocks over the dist transport (gloo). Here both "hosts" are
127.0.0.1 with separate run dirs: a router-only supervisor and a workers-only one. Greedy tokens equal
transformers `generate`; every block comes back. Every TCP socket is CURVE-authenticated: a peer without the
cluster's keys cannot make a worker act."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pdserve.core import ipc
from pdserve.core.curve import ClusterKeys
from pdserve.core.messages import GenerateCmd, Sampling, encode, pack_token_ids
from tests.e2e.cluster import Cluster
from tests.e2e.test_cluster import NEW_TOKENS, generate_all, tokens_of
from tests.hf_reference import hf_greedy, random_prompts

OFFSETS = (0, 100, 101, 102, 5000, 5002)
"""Ports of 1 prefill + 1 decode worker from base_port (core/ipc.py Topology)."""


def free_base_port() -> int:
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(20000, 40000)
        try:
            for off in OFFSETS:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


@pytest.fixture(scope="module")
def hosts(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Cluster]]:
    root = tmp_path_factory.mktemp("hosts")
    topology = root / "topology.json"
    topology.write_text(json.dumps({"router": "127.0.0.1", "prefill": ["127.0.0.1"], "decode": ["127.0.0.1"],
                                    "base_port": free_base_port()}))  # fmt: skip
    ClusterKeys.make().write(root / "topology.keys")  # NOTE: as copied to every host; the default --cluster-keys
    common = ("--num-blocks", "256", "--topology", str(topology), "--transport", "dist")
    workers = Cluster(tiny_llama_dir, root / "host-b", 1, 1, *common, "--roles", "prefill-0,decode-0")
    router = Cluster(tiny_llama_dir, root / "host-a", 1, 1, *common, "--roles", "router")
    try:
        router.wait_ready()
        yield router, workers
    finally:
        router.stop()
        workers.stop()


def test_a_cluster_over_two_hosts_matches_transformers(hosts: tuple[Cluster, Cluster], tiny_llama_dir: Path) -> None:
    router, workers = hosts
    prompts = random_prompts(1024, [2 + 13 * i for i in range(8)], seed=82)
    got = [tokens_of(r) for r in asyncio.run(generate_all(router.address, prompts))]
    assert got == hf_greedy(tiny_llama_dir, prompts, NEW_TOKENS)
    assert any("pdserve workers ready: prefill-0, decode-0" in line for line in workers.output)
    assert [r["name"] for r in router.status()["roles"]] == ["router"]
    assert not list(router.run_dir.glob("*.sock")) and not list(workers.run_dir.glob("*.sock"))  # TCP only
    workers.wait_for(lambda: workers.stats("decode", 0)["num_free_blocks"] == workers.stats("decode", 0)[
        "num_total_blocks"], 5.0, "decode blocks back")  # fmt: skip
    assert workers.stats("decode", 0)["counters"]["blocks_pulled"] > 0
    assert "KV transport dist" in (workers.run_dir / "logs" / "decode-0.log").read_text()


def test_a_peer_without_the_cluster_keys_cannot_make_a_worker_act(hosts: tuple[Cluster, Cluster]) -> None:
    _, workers = hosts
    addr = ipc.prefill_addr(workers.run_dir, 0)
    before = workers.stats("prefill", 0)["counters"]
    keys, other = ipc.cluster_keys(str(workers.run_dir)), ClusterKeys.make()
    ctx = zmq.Context()
    try:
        for name, intruder in (("plain", None), ("wrong-client-key", ClusterKeys(keys.server_public,
                               keys.server_secret, other.client_public, other.client_secret))):  # fmt: skip
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            if intruder is not None:
                intruder.connect_as_client(sock)
            sock.connect(addr)
            cmd = GenerateCmd(f"intruder-{name}", pack_token_ids([1, 2, 3]), Sampling(max_tokens=4), decode_worker=0)
            sock.send(encode(cmd), flags=zmq.NOBLOCK)
        log = workers.run_dir / "logs" / "prefill-0.log"
        workers.wait_for(lambda: "refused a ZMQ peer at 127.0.0.1" in log.read_text(), 5.0, "ZAP refusal logged")
        workers.wait_for(lambda: "failed the CURVE handshake" in log.read_text(), 5.0, "handshake failure logged")
        time.sleep(1.0)
    finally:
        ctx.destroy(linger=0)
    assert "intruder" not in log.read_text()
    assert workers.stats("prefill", 0)["counters"] == before
    assert (workers.run_dir / "cluster_keys.json").stat().st_mode & 0o777 == 0o600
