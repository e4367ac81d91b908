"""Prefill on GPU 0, decode on GPU 1 (--prefill-gpus 0 --decode-gpus 1): by default the decode worker maps the
prefill pool by CUDA IPC and pulls with peer copies; forced to the dist transport, the blocks go over NCCL.
Greedy tokens in fp32 equal transformers on the GPU; MPS stays off (no GPU is shared); every block comes back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pdserve.router.placement import gpu_uuids, within_visible
from tests.e2e.cluster import Cluster
from tests.gpu.test_cluster_cuda import assert_serves_like_transformers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def visible_devices(pid: int) -> str:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"CUDA_VISIBLE_DEVICES=")), "")


def host_gpus(flag: str, by_uuid: bool = False) -> str:
    """A worker's CUDA_VISIBLE_DEVICES for a --prefill-gpus / --decode-gpus list: its indices within this process's
    CUDA_VISIBLE_DEVICES, and under MPS (by_uuid) those GPUs' UUIDs."""
    gpus = within_visible(flag.split(","), os.environ.get("CUDA_VISIBLE_DEVICES"), "") or []
    uuids = gpu_uuids() if by_uuid else {}
    return ",".join(uuids.get(g, g) for g in gpus)


def test_prefill_and_decode_on_two_gpus_match_transformers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    flags = ("--num-blocks", "512", "--prefill-gpus", "0", "--decode-gpus", "1")
    cluster = Cluster(tiny_llama_dir, tmp_path / "run", 1, 1, *flags, device="cuda")
    try:
        cluster.wait_ready()
        assert visible_devices(cluster.pid("prefill-0")) == host_gpus("0")
        assert visible_devices(cluster.pid("decode-0")) == host_gpus("1,0")
        assert_serves_like_transformers(cluster, tiny_llama_dir, seed=63)
        assert not any("MPS on" in line for line in cluster.output)
    finally:
        cluster.stop()


def test_forced_nccl_dist_transport_between_two_gpus_matches_transformers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """--transport dist on CUDA pools: the blocks travel over NCCL point-to-point (headers over gloo)."""
    flags = ("--num-blocks", "512", "--prefill-gpus", "0", "--decode-gpus", "1", "--transport", "dist")
    cluster = Cluster(tiny_llama_dir, tmp_path / "run", 1, 1, *flags, device="cuda")
    try:
        cluster.wait_ready()
        assert_serves_like_transformers(cluster, tiny_llama_dir, seed=64)
        assert "KV transport dist with prefill worker 0" in (cluster.run_dir / "logs" / "decode-0.log").read_text()
    finally:
        cluster.stop()
