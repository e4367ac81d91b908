"""The disaggregation primitive in one process: a prefill engine detaches requests after their first token,
their blocks are copied into a decode engine that adopts them; the tokens equal a single engine's."""

from __future__ import annotations

from pathlib import Path

from core.config import CacheConfig, EngineConfig, ModelConfig
from core.engine import Engine
from core.sampler import SamplingState
from core.sampling_params import SamplingParams
from tests.hf_reference import random_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def test_detach_copy_adopt_equals_single_engine(tiny_llama_dir: Path) -> None:
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=64))
    prefill, decode, single = Engine(cfg), Engine(cfg), Engine(cfg)
    prompts = random_prompts(1024, (5, 16, 33, 1), seed=11)
    expected = single.generate(prompts, PARAMS)
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, PARAMS)
    first: dict[str, int] = {}
    while prefill.has_unfinished():
        for out in prefill.step():
            first[out.request_id] = out.new_token_ids[0]
            req = prefill.detach(out.request_id)
            sampling = SamplingState(req.sampling.params, req.sampling.eos_token_ids, req.sampling.num_generated)
            adoption = decode.adopt(req.request_id, req.token_ids, req.num_prompt_tokens, sampling)
            assert adoption is not None
            src = adoption.sources(req.block_ids)
            decode.runner.kv_pool[:, :, adoption.dst] = prefill.runner.kv_pool[:, :, src]
            prefill.release_blocks(req.block_ids)
    assert prefill.pool.num_used_blocks == 0
    rest: dict[str, list[int]] = {rid: [] for rid in first}
    while decode.has_unfinished():
        for out in decode.step():
            rest[out.request_id].extend(out.new_token_ids)
    got = [[first[f"r{i}"], *rest[f"r{i}"]] for i in range(len(prompts))]
    assert got == expected
    assert decode.stats.num_prefill_tokens_computed == 0
    assert decode.pool.num_used_blocks == 0
