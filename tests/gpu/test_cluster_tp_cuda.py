"""TP groups on two GPUs (NCCL inside each group, CUDA IPC between groups, head-sliced pulls): prefill and decode
groups of equal and of different TP sizes, sharing the two GPUs under the MPS split, and colocated TP 2 serve
transformers' fp32 greedy tokens; every block comes back; a killed rank > 0 brings its whole group back."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc
import pytest
import torch

from tests.e2e.cluster import Cluster
from tests.e2e.test_cluster import generate_all, tokens_of
from tests.gpu.test_cluster_cuda import assert_serves_like_transformers
from tests.gpu.test_two_gpus import host_gpus, visible_devices
from tests.hf_reference import random_prompts
from tests.kernels.test_engine_cuda import NEW_TOKENS, hf_greedy_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]
SHAPES = {
    "p2d2-shared": ("--prefill-tp", "2", "--decode-tp", "2", "--prefill-gpus", "0,1", "--decode-gpus", "0,1"),
    "p2d1": ("--prefill-tp", "2", "--prefill-gpus", "0,1", "--decode-gpus", "1"),
    "p1d2": ("--decode-tp", "2", "--prefill-gpus", "0", "--decode-gpus", "0,1"),
    # NOTE: NCCL refuses two ranks of one communicator on one GPU: decode rank r (GPU 1 - r) pulls its heads over
    # NCCL from prefill rank r (GPU r), the only pairs of different GPUs that hold them all on two GPUs
    "p2d2-crossed-dist": ("--prefill-tp", "2", "--decode-tp", "2", "--prefill-gpus", "0,1", "--decode-gpus", "1,0",
                          "--transport", "dist"),
}  # fmt: skip


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tp_groups_on_two_gpus_match_transformers(shape: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    cluster = Cluster(tiny_llama_dir, tmp_path / "run", 1, 1, "--num-blocks", "512", *SHAPES[shape], device="cuda")
    try:
        cluster.wait_ready(timeout=240.0)
        assert_serves_like_transformers(cluster, tiny_llama_dir, seed=71)
        decode = cluster.stats("decode", 0)
        assert decode["layout"]["tp_size"] == (1 if shape == "p2d1" else 2)
        transport = "dist" if shape.endswith("dist") else "cuda_ipc"
        assert f"KV transport {transport}" in (cluster.run_dir / "logs" / "decode-0.log").read_text()
        if shape == "p2d2-shared":
            assert visible_devices(cluster.pid("decode-0")) == host_gpus("0,1", by_uuid=True)  # MPS: by UUID
            leader, rank1 = decode["ranks"]
            os.kill(rank1, signal.SIGKILL)
            cluster.wait_for(lambda: cluster.stats("decode", 0)["pid"] != leader, 120.0, "decode-0 back")
            cluster.wait_for(lambda: len(cluster.stats("decode", 0)["ranks"]) == 2, 120.0, "both ranks back")
            cluster.wait_for(lambda: _serves(cluster), 30.0, "the router to take the restarted group")
            assert_serves_like_transformers(cluster, tiny_llama_dir, seed=72)
    finally:
        cluster.stop()


def test_colocated_tp_2_matches_transformers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cluster = Cluster(tiny_llama_dir, tmp_path / "run", 1, 1, "--num-blocks", "512", "--colocated", "--tp", "2",
                      device="cuda")  # fmt: skip
    try:
        cluster.wait_ready(timeout=240.0)
        prompts = random_prompts(1024, [1 + 9 * i for i in range(16)], seed=73)
        responses = asyncio.run(generate_all(cluster.address, prompts, max_tokens=NEW_TOKENS))
        assert [tokens_of(r) for r in responses] == hf_greedy_cuda(tiny_llama_dir, prompts)[0]
        assert len(cluster.stats("decode", 0)["ranks"]) == 2
    finally:
        cluster.stop()


def _serves(cluster: Cluster) -> bool:
    """One short request streams (False while the router answers UNAVAILABLE: it has not heard the worker yet)."""
    try:
        asyncio.run(generate_all(cluster.address, [[1, 2, 3]], max_tokens=2))
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return False
    return True
