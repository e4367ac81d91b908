"""Request migration at the engine on CUDA (fp32, IEEE; Triton kernels in CUDA graphs): requests resumed as
prompt + tokens so far continue with exactly the greedy tokens they had uninterrupted. The resumed token comes
from the prefill path (the KV append rotating q and K, prefill attention, the last layer on its sampling
rows), the uninterrupted one from a decode step (rope on the decode kernel's q load): the two paths must
agree token for token, with the prefix cache warm (a partial hit) and cold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.engine import Engine
from pdserve.core.sampling_params import SamplingParams
from tests.hf_reference import random_prompts

pytestmark = pytest.mark.gpu
NUM_REQUESTS = 100
NEW_TOKENS = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def engine(model_dir: Path) -> Engine:
    cfg = EngineConfig(ModelConfig.from_pretrained(model_dir), CacheConfig(num_blocks=1024), device="cuda")
    return Engine(cfg)


def resume_all(engine: Engine, prompts: list[list[int]], whole: list[list[int]], cuts: list[int]) -> list[list[int]]:
    """Every request added at once as prompt + its first cut tokens; the tokens each generates from there."""
    got: dict[str, list[int]] = {}
    for i, (prompt, tokens, cut) in enumerate(zip(prompts, whole, cuts, strict=True)):
        engine.add_request(f"resumed-{i}", prompt + tokens[:cut], GREEDY, cut)
        got[f"resumed-{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    return [got[f"resumed-{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_resumed_requests_continue_exactly_on_gpu(tiny_llama_dir: Path, cache: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    first = engine(tiny_llama_dir)
    prompts = random_prompts(1024, [8 + (i * 7) % 40 for i in range(NUM_REQUESTS)], seed=61)
    whole = first.generate(prompts, GREEDY)
    cuts = [1 + (i * 13) % (NEW_TOKENS - 1) for i in range(NUM_REQUESTS)]
    rest = resume_all(first if cache == "warm" else engine(tiny_llama_dir), prompts, whole, cuts)
    wrong = [(i, cuts[i]) for i in range(NUM_REQUESTS) if rest[i] != whole[i][cuts[i] :]]
    assert not wrong, f"{len(wrong)} resumed requests diverged (index, cut): {wrong[:10]}"
    assert first.pool.num_used_blocks == 0
