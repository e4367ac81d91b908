"""The engine at TP 2 on two GPUs (NCCL, rank r on GPU r), with CUDA graphs (the all-reduces and the logits'
all-gather captured inside them) and eagerly: fp32 greedy tokens equal TP 1 on one GPU and transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.engine import Engine
from pdserve.core.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, random_prompts
from tests.unit.test_tensor_parallel import NEW_TOKENS, tp_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


@pytest.mark.parametrize(
    ("family", "vocab", "eager"),
    [("tiny_llama_dir", 1024, False), ("tiny_llama_dir", 1024, True), ("tiny_gpt2_dir", 50257, False)],
)
def test_engine_at_tp_2_on_two_gpus_matches_tp_1_and_transformers(
    family: str, vocab: int, eager: bool, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_dir = request.getfixturevalue(family)
    prompts = random_prompts(vocab, [3, 17, 40, 200], seed=81)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    one = Engine(EngineConfig(ModelConfig.from_pretrained(model_dir), CacheConfig(num_blocks=128), device="cuda:0"))
    reference = one.generate(prompts, params)
    del one
    torch.cuda.empty_cache()
    assert tp_greedy(model_dir, prompts, 2, tmp_path, device="cuda", eager=eager) == reference
    assert reference == hf_greedy(model_dir, prompts, NEW_TOKENS)
