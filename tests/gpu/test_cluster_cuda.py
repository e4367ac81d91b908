"""The cluster on one GPU: --device cuda, the cuda_ipc transport, 1 prefill + 1 decode; greedy tokens in fp32
equal transformers on the same GPU (a checkpoint, and seeded dummy weights under an MPS split)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.core.config import ModelConfig
from pdserve.core.models import load_model
from pdserve.core.models.loading import unmerged_state_dict
from pdserve.kernels.attention import TorchAttention
from tests.e2e.cluster import Cluster
from tests.e2e.test_cluster import generate_all, tokens_of, wait_blocks_returned
from tests.hf_reference import random_prompts
from tests.kernels.test_engine_cuda import NEW_TOKENS, hf_greedy_cuda
from tests.models import make_tiny_llama

pytestmark = pytest.mark.gpu


def assert_serves_like_transformers(cluster: Cluster, model_dir: Path, seed: int) -> None:
    """16 prompts through the cluster: greedy tokens equal transformers on the GPU, every block comes back,
    and the decode worker pulled blocks (it did not prefill)."""
    prompts = random_prompts(1024, [1 + 9 * i for i in range(16)], seed=seed)
    responses = asyncio.run(generate_all(cluster.address, prompts, max_tokens=NEW_TOKENS))
    expected, _ = hf_greedy_cuda(model_dir, prompts)
    assert [tokens_of(r) for r in responses] == expected
    wait_blocks_returned(cluster)
    decode = cluster.stats("decode", 0)["counters"]
    assert decode["prefill_tokens_computed"] == 0 and decode["blocks_pulled"] > 0


def test_cuda_cluster_matches_transformers_on_gpu(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cluster = Cluster(tiny_llama_dir, tmp_path / "run", 1, 1, "--num-blocks", "512", device="cuda")
    try:
        cluster.wait_ready()
        assert_serves_like_transformers(cluster, tiny_llama_dir, seed=61)
        assert "KV transport cuda_ipc" in (tmp_path / "run" / "logs" / "decode-0.log").read_text()
        if shutil.which("nvidia-cuda-mps-control"):
            assert any("MPS on, SM share prefill/decode 50/50%" in line for line in cluster.output)
    finally:
        cluster.stop()


def hf_with_dummy_weights(model_dir: Path) -> torch.nn.Module:
    """transformers' Llama holding the very weights a worker draws with --load-format dummy (same seed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ours = load_model(
        ModelConfig.from_pretrained(model_dir, dtype="float32", load_format="dummy"), TorchAttention(), "cuda"
    )
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32).cuda().eval()
    result = hf.load_state_dict(unmerged_state_dict(ours), strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
    return hf


def hf_generate(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            seq = model.generate(  # type: ignore[operator]
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
        out.append(seq[0, len(prompt) :].tolist())
    return out


def test_dummy_weight_cluster_under_mps_matches_transformers(tmp_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = make_tiny_llama(
        tmp_path / "model", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, intermediate_size=512
    )
    flags = ("--num-blocks", "512", "--load-format", "dummy", "--dtype", "float32", "--mps", "on")
    cluster = Cluster(model_dir, tmp_path / "run", 1, 1, *flags, device="cuda")
    try:
        cluster.wait_ready()
        prompts = random_prompts(1024, [1 + 13 * i for i in range(12)], seed=62)
        responses = asyncio.run(generate_all(cluster.address, prompts, max_tokens=NEW_TOKENS))
        assert [tokens_of(r) for r in responses] == hf_generate(hf_with_dummy_weights(model_dir), prompts)
        wait_blocks_returned(cluster)
        if shutil.which("nvidia-cuda-mps-control"):
            assert any("MPS on, SM share prefill/decode 50/50%" in line for line in cluster.output)
    finally:
        cluster.stop()
