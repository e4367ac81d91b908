"""Greedy output of the engine equals transformers `generate`, token for token (CPU, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.core.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, random_prompts

NEW_TOKENS = 48
MIXED_LENGTHS = (1, 5, 16, 17, 31, 64, 3, 100, 47)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_engine(model_dir: Path, chunk: int | None = None, batched_tokens: int = 4096, **cache: object) -> Engine:
    cfg = EngineConfig(
        model=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(num_blocks=256, **cache),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(max_num_batched_tokens=batched_tokens, prefill_chunk_size=chunk),
    )
    return Engine(cfg)


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole-prefill", "chunked-prefill"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_batch_of_mixed_lengths_matches_hf(family: str, chunk: int | None, request) -> None:
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    engine = make_engine(model_dir, chunk=chunk, batched_tokens=64 if chunk else 4096)
    prompts = random_prompts(engine.config.model.vocab_size, MIXED_LENGTHS, seed=1)
    got = engine.generate(prompts, GREEDY)
    assert got == hf_greedy(model_dir, prompts, NEW_TOKENS)
    assert engine.pool.num_used_blocks == 0


@pytest.mark.slow
def test_smollm2_greedy_matches_hf(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
    chats = [
        tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in texts
    ]
    prompts: list[list[int]] = [tok(str(c), add_special_tokens=False)["input_ids"] for c in chats]
    prompts.append(tok("The quick brown fox jumps over the lazy dog. Once upon a time")["input_ids"])
    engine = make_engine(smollm2_dir, chunk=16, batched_tokens=96)
    got = engine.generate(prompts, GREEDY)
    assert got == hf_greedy(smollm2_dir, prompts, NEW_TOKENS)
    assert "Paris" in tok.decode(got[0])
