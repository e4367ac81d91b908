"""The cluster on one GPU: --device cuda, the cuda_ipc transport, 1 prefill + 1 decode; greedy tokens in fp32
equal transformers on the same GPU."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.test_cluster import generate_all, tokens_of, wait_blocks_returned
from tests.hf_reference import random_prompts
from tests.kernels.test_engine_cuda import NEW_TOKENS, hf_greedy_cuda

pytestmark = pytest.mark.gpu


def test_cuda_cluster_matches_transformers_on_gpu(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cluster = Cluster(tiny_llama_dir, tmp_path / "run", 1, 1, "--num-blocks", "512", device="cuda")
    try:
        cluster.wait_ready()
        prompts = random_prompts(1024, [1 + 9 * i for i in range(16)], seed=61)
        responses = asyncio.run(generate_all(cluster.address, prompts, max_tokens=NEW_TOKENS))
        expected, _ = hf_greedy_cuda(tiny_llama_dir, prompts)
        assert [tokens_of(r) for r in responses] == expected
        wait_blocks_returned(cluster)
        decode = cluster.stats("decode", 0)["counters"]
        assert decode["prefill_tokens_computed"] == 0 and decode["blocks_pulled"] > 0
        assert "KV transport cuda_ipc" in (tmp_path / "run" / "logs" / "decode-0.log").read_text()
        if shutil.which("nvidia-cuda-mps-control"):
            assert any("MPS on, SM share prefill/decode 50/50%" in line for line in cluster.output)
    finally:
        cluster.stop()
