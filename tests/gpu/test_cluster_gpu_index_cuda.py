"""A whole cluster pinned to one host GPU other than 0 by CUDA_VISIBLE_DEVICES, with MPS on: the private daemon sees
that GPU alone, and its workers still find it (router/placement.py Mps names it by UUID), serving greedy tokens equal
to transformers. Before, a worker's index was read against the daemon's list: "No CUDA GPUs are available"."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pdserve.router.placement import gpu_uuids
from tests.e2e.cluster import Cluster
from tests.gpu.test_cluster_cuda import assert_serves_like_transformers

pytestmark = pytest.mark.gpu


def a_gpu_not_zero() -> str | None:
    """The last host GPU index this process may use (its CUDA_VISIBLE_DEVICES, else every GPU), unless it is 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    indices = [g.strip() for g in visible.split(",")] if visible else sorted(gpu_uuids(), key=int)
    indices = [g for g in indices if g.isdigit() and g != "0"]
    return indices[-1] if indices else None


@pytest.mark.skipif(not shutil.which("nvidia-cuda-mps-control"), reason="needs MPS")
def test_cluster_under_mps_on_a_host_gpu_named_by_index(tiny_llama_dir: Path, tmp_path: Path) -> None:
    gpu = a_gpu_not_zero()
    if gpu is None:
        pytest.skip("needs a host GPU other than 0 in CUDA_VISIBLE_DEVICES (or none set on a multi-GPU host)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    cluster = Cluster(tiny_llama_dir, tmp_path / "run", 1, 1, "--num-blocks", "512", "--mps", "on", device="cuda",
                      env=env)  # fmt: skip
    try:
        cluster.wait_ready()
        assert any("MPS on, SM share prefill/decode 50/50%" in line for line in cluster.output)
        assert_serves_like_transformers(cluster, tiny_llama_dir, seed=63)
    finally:
        cluster.stop()
