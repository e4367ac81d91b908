"""The disaggregation primitive in one process: a prefill engine detaches requests after their first token,
their blocks are copied into a decode engine that adopts them; the tokens equal a single engine's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.core import kv_cache_manager
from pdserve.core.block_pool import hash_full_blocks
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.core.errors import InvalidRequestError
from pdserve.core.sampler import SamplingState
from pdserve.core.sampling_params import SamplingParams
from tests.hf_reference import random_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("lengths", [(5, 16, 33, 1), (70, 5, 130, 63)], ids=["short", "long"])
def test_detach_copy_adopt_equals_single_engine(tiny_llama_dir: Path, lengths: tuple[int, ...]) -> None:
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=64))
    prefill, decode, single = Engine(cfg), Engine(cfg), Engine(cfg)
    prompts = random_prompts(1024, lengths, seed=11)
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
            adopted = decode.requests[req.request_id]
            assert adopted.token_ids == req.token_ids
            src = adoption.sources(req.block_ids)
            decode.runner.kv_pool[:, :, adoption.dst] = prefill.runner.kv_pool[:, :, src]
            prefill.release_blocks(req.block_ids)
            assert adopted not in decode.scheduler.running  # not scheduled until its copy is done
            decode.start_adopted(req.request_id)
    assert prefill.pool.num_used_blocks == 0
    rest: dict[str, list[int]] = {rid: [] for rid in first}
    while decode.has_unfinished():
        for out in decode.step():
            rest[out.request_id].extend(out.new_token_ids)
    got = [[first[f"r{i}"], *rest[f"r{i}"]] for i in range(len(prompts))]
    assert got == expected
    assert decode.stats.num_prefill_tokens_computed == 0
    assert decode.pool.num_used_blocks == 0


def test_a_handoff_carries_its_block_hashes_and_the_decode_engine_hashes_nothing(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=64))
    bs = cfg.cache.block_size
    prefill, decode = Engine(cfg), Engine(cfg)
    (prompt,) = random_prompts(1024, (4 * bs + 6,), seed=12)
    prefill.add_request("a", prompt, PARAMS)
    (out,) = prefill.step()
    req = prefill.detach("a")
    hashes = prefill.computed_block_hashes(req)
    assert hashes == hash_full_blocks(prompt, bs)  # the 4 full blocks of the computed prompt
    sampling = SamplingState(req.sampling.params, req.sampling.eos_token_ids, req.sampling.num_generated)
    with pytest.raises(InvalidRequestError, match="block hashes"):
        decode.adopt("a", req.token_ids, req.num_prompt_tokens, sampling, hashes[:-1])
    hashed: list[object] = []
    real = kv_cache_manager.hash_full_blocks

    def counted(*args: Any) -> list[int]:
        hashed.append(args)
        return real(*args)

    monkeypatch.setattr(kv_cache_manager, "hash_full_blocks", counted)
    adoption = decode.adopt("a", req.token_ids, req.num_prompt_tokens, sampling, hashes)
    assert adoption is not None and hashed == []
    decode.runner.kv_pool[:, :, adoption.dst] = prefill.runner.kv_pool[:, :, adoption.sources(req.block_ids)]
    prefill.release_blocks(req.block_ids)
    decode.start_adopted("a")
    monkeypatch.undo()
    # the registered hashes are the blocks' own: a local prompt with the same first 4 blocks finds them
    other = [*prompt[: 4 * bs], 1, 2, 3]
    got = decode.generate([other], PARAMS)
    assert decode.stats.num_cached_prompt_tokens == 4 * bs
    assert got == Engine(cfg).generate([other], PARAMS)


def test_adopted_requests_count_toward_max_num_seqs_until_they_start(tiny_llama_dir: Path) -> None:
    """A request adopted while its KV is copied holds a seat: a prompt queued meanwhile waits for one (it would
    otherwise join the batch, and the adopted request's start would overflow it), and so does another handoff."""
    model = ModelConfig.from_pretrained(tiny_llama_dir)
    cfg = EngineConfig(model, CacheConfig(num_blocks=64), SchedulerConfig(max_num_seqs=2))
    prefill, decode = Engine(cfg), Engine(cfg)
    a, b, c = random_prompts(1024, (20, 21, 22), seed=13)
    decode.add_request("running", a, PARAMS)
    decode.step()
    prefill.add_request("h", b, PARAMS)
    prefill.step()
    req = prefill.detach("h")
    sampling = SamplingState(req.sampling.params, req.sampling.eos_token_ids, req.sampling.num_generated)
    assert decode.adopt("h", req.token_ids, req.num_prompt_tokens, sampling) is not None
    assert decode.adopt("h2", req.token_ids, req.num_prompt_tokens, sampling) is None  # 1 running + 1 adopted
    decode.add_request("late", c, PARAMS)
    for _ in range(3):
        decode.step()
        assert [r.request_id for r in decode.scheduler.running] == ["running"] and decode.num_adopted == 1
    decode.start_adopted("h")
    assert decode.num_adopted == 0 and len(decode.scheduler.running) == 2 and decode.scheduler.waiting
    decode.abort("h")
    decode.step()
    assert {r.request_id for r in decode.scheduler.running} == {"running", "late"}
