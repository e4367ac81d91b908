"""Qwen3, Qwen3-MoE, Mixtral and Qwen2-MoE (tiny random checkpoints made and saved by transformers): greedy
tokens of the engine equal transformers `generate` token for token (CPU, fp32), with prefix caching on and
chunked prefill forced, and the checkpoints' names and shapes load (whole and sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.core.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, random_prompts

NEW_TOKENS = 36
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
FAMILIES = ["qwen3", "qwen3_moe", "mixtral", "qwen2_moe"]


def chunked_engine(model_dir: Path) -> Engine:
    """Prefix caching on (the default), prompts prefilled in chunks of 7 tokens, at most 32 tokens a pass."""
    return Engine(
        EngineConfig(
            ModelConfig.from_pretrained(model_dir),
            CacheConfig(num_blocks=256, block_size=4, enable_prefix_caching=True),
            SchedulerConfig(max_num_batched_tokens=32, prefill_chunk_size=7),
        )
    )


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Prompts of mixed lengths, most of them starting with the same 13 tokens (so later ones hit the cache)."""
    prefix = random_prompts(1024, [13], seed=seed)[0]
    tails = random_prompts(1024, (1, 6, 20, 3, 41), seed=seed + 1)
    return [prefix + t for t in tails] + random_prompts(1024, (2, 30), seed=seed + 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_with_prefix_caching_and_chunked_prefill(family: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    engine = chunked_engine(model_dir)
    prompts = shared_prefix_prompts(seed=11)
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    assert engine.generate(prompts[:1], GREEDY) == expected[:1]  # the shared prefix enters the cache
    assert engine.generate(prompts, GREEDY) == expected
    assert engine.stats.num_cached_prompt_tokens >= 12 * 5
    assert engine.generate(prompts[2:4], GREEDY) == expected[2:4]  # whole-prompt hits now
    assert engine.pool.num_used_blocks == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_checkpoint_loads_as_the_single_file(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(sharded, max_shard_size="100KB")
    assert len(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    prompts = random_prompts(1024, (7, 20), seed=5)
    one = Engine(EngineConfig(ModelConfig.from_pretrained(model_dir), CacheConfig(num_blocks=64)))
    many = Engine(EngineConfig(ModelConfig.from_pretrained(sharded), CacheConfig(num_blocks=64)))
    assert many.generate(prompts, GREEDY) == one.generate(prompts, GREEDY)
