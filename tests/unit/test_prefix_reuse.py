"""Prefix caching in the engine: shared blocks, whole-prompt hits with no forward pass, copy-on-write,
eviction of cached logits, preemption and abort; every output equals the cache-off engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.core.sampler import SamplingState
from pdserve.core.sampling_params import SamplingParams
from tests.hf_reference import random_prompts

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def engine_for(model_dir: Path, caching: bool = True, num_blocks: int = 128, **kw: object) -> Engine:
    cache = CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=caching, **kw)  # type: ignore[arg-type]
    return Engine(EngineConfig(ModelConfig.from_pretrained(model_dir), cache, SchedulerConfig(max_num_seqs=8)))


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> Engine:
    return engine_for(tiny_llama_dir, caching=False)


def uncached(reference: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return reference.generate(prompts, params)


def test_shared_prefix_runs_only_new_tokens(tiny_llama_dir: Path, reference: Engine) -> None:
    prefix, a, b = random_prompts(1024, (3 * BS + 5, 9, 11), seed=2)
    engine = engine_for(tiny_llama_dir)
    engine.generate([prefix + a], GREEDY)
    before = engine.stats.num_prefill_tokens_computed
    got = engine.generate([prefix + b], GREEDY)
    # 3 full blocks (48 tokens) are reused; the 5 leftover prefix tokens sit in a partial block and rerun.
    assert engine.stats.num_prefill_tokens_computed - before == len(prefix + b) - 3 * BS
    assert got == uncached(reference, [prefix + b])


def test_concurrent_requests_share_prefix_blocks(tiny_llama_dir: Path) -> None:
    prefix, a, b = random_prompts(1024, (3 * BS, 4, 6), seed=3)
    engine = engine_for(tiny_llama_dir)
    engine.add_request("a", prefix + a, GREEDY)
    engine.step()  # a is prefilled; its 3 full blocks are now cached
    engine.add_request("b", prefix + b, GREEDY)
    engine.step()
    blocks_a, blocks_b = engine.requests["a"].block_ids, engine.requests["b"].block_ids
    assert blocks_a[:3] == blocks_b[:3]
    assert all(engine.pool.ref_cnt(blk) == 2 for blk in blocks_a[:3])
    assert set(blocks_a[3:]).isdisjoint(blocks_b[3:])


@pytest.mark.parametrize("length", [3 * BS + 7, 3 * BS], ids=["partial-tail", "block-aligned"])
def test_whole_prompt_hit_runs_no_forward_pass(tiny_llama_dir: Path, reference: Engine, length: int) -> None:
    (prompt,) = random_prompts(1024, (length,), seed=4)
    engine = engine_for(tiny_llama_dir)
    first = engine.generate([prompt], GREEDY)
    calls = engine.num_forward_calls
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    assert engine.generate([prompt], one) == [first[0][:1]]
    assert engine.num_forward_calls == calls
    assert engine.stats.num_full_hits == 1
    assert engine.generate([prompt], GREEDY) == first == uncached(reference, [prompt])
    assert engine.pool.num_used_blocks == 0


class CountingSampler:
    """Wraps the engine's sampler and counts the rows it samples."""

    def __init__(self, engine: Engine) -> None:
        self.inner, self.rows = engine.sampler, 0
        engine.sampler = self  # type: ignore[assignment]

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        self.rows += len(states)
        return self.inner.sample(logits, states)


def test_a_plain_greedy_hit_takes_the_cached_greedy_token_without_sampling(tiny_llama_dir: Path) -> None:
    (prompt,) = random_prompts(1024, (2 * BS + 5,), seed=14)
    engine = engine_for(tiny_llama_dir)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    first = engine.generate([prompt], one)
    sampler = CountingSampler(engine)
    assert engine.generate([prompt, prompt], one) == [first[0]] * 2
    assert sampler.rows == 0 and engine.stats.num_full_hits == 2
    # min_tokens masks the stop ids: the row's argmax may not be its token, so it samples the cached row
    masked = SamplingParams(temperature=0.0, max_tokens=1, min_tokens=1)
    engine.generate([prompt], masked)
    assert sampler.rows == 1 and engine.stats.num_full_hits == 3


def test_a_greedy_hit_on_a_row_cached_by_random_sampling_fills_its_greedy_token(tiny_llama_dir: Path) -> None:
    (prompt,) = random_prompts(1024, (2 * BS + 5,), seed=15)
    reference = engine_for(tiny_llama_dir, caching=False).generate([prompt], GREEDY)[0][:1]
    engine = engine_for(tiny_llama_dir)
    engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=1, seed=3, ignore_eos=True))
    sampler = CountingSampler(engine)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    assert engine.generate([prompt], one) == [reference]  # samples the cached row once
    assert engine.generate([prompt], one) == [reference]  # then knows its token
    assert sampler.rows == 1 and engine.stats.num_full_hits == 2


def test_concurrent_whole_prompt_hits_copy_the_shared_tail(tiny_llama_dir: Path, reference: Engine) -> None:
    (prompt,) = random_prompts(1024, (2 * BS + 3,), seed=5)
    engine = engine_for(tiny_llama_dir)
    expected = uncached(reference, [prompt])[0]
    engine.generate([prompt], GREEDY)
    # Three hits on the same cached tail block decode side by side: each must copy it before writing.
    assert engine.generate([prompt, prompt, prompt], GREEDY) == [expected] * 3
    assert engine.stats.num_full_hits == 3
    assert engine.pool.num_used_blocks == 0


def test_evicted_logits_fall_back_to_recompute(tiny_llama_dir: Path, reference: Engine) -> None:
    prompts = random_prompts(1024, (2 * BS + 1, 2 * BS, 2 * BS + 9), seed=6)
    engine = engine_for(tiny_llama_dir, max_cached_logits=1)
    expected = uncached(reference, prompts)
    assert engine.generate(prompts, GREEDY) == expected
    assert engine.generate(prompts, GREEDY) == expected  # only the last prompt's logits survived
    assert engine.stats.num_full_hits == 1


def test_preemption_keeps_outputs_exact(tiny_llama_dir: Path, reference: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = random_prompts(1024, (20, 30, 25, 18), seed=7)
    engine = engine_for(tiny_llama_dir, num_blocks=12)  # 11 usable blocks for 4 requests of up to 5
    assert engine.generate(prompts, params) == uncached(reference, prompts, params)
    assert engine.stats.num_preemptions > 0
    assert engine.pool.num_used_blocks == 0


def test_a_preempted_request_gives_its_blocks_back_within_the_schedule(tiny_llama_dir: Path) -> None:
    """Unlike a finished request's (freed at the flush), a victim's blocks are what the schedule preempted it for."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = engine_for(tiny_llama_dir, num_blocks=12)
    for i, prompt in enumerate(random_prompts(1024, (20, 30, 25, 18), seed=7)):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished():
        engine.step()
        assert all(not r.block_ids for r in engine.scheduler.waiting), "a preempted request still holds blocks"
    assert engine.stats.num_preemptions > 0


def test_abort_frees_every_block(tiny_llama_dir: Path) -> None:
    prompts = random_prompts(1024, (40, 33), seed=8)
    engine = engine_for(tiny_llama_dir)
    engine.add_request("x", prompts[0], GREEDY)
    engine.add_request("y", prompts[1], GREEDY)
    engine.step()
    engine.step()
    out = engine.abort("x")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert engine.abort("x") is None
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_used_blocks == 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1


def test_cache_off_never_reuses(tiny_llama_dir: Path, reference: Engine) -> None:
    (prompt,) = random_prompts(1024, (3 * BS + 2,), seed=9)
    reference.generate([prompt], GREEDY)
    before = reference.stats.num_prefill_tokens_computed
    reference.generate([prompt], GREEDY)
    assert reference.stats.num_prefill_tokens_computed - before == len(prompt)
    assert reference.pool.num_cached_blocks == 0


def test_a_prompt_enters_the_cache_after_its_first_token_is_returned(tiny_llama_dir: Path, reference: Engine) -> None:
    (prompt,) = random_prompts(1024, (3 * BS + 5,), seed=11)
    engine = engine_for(tiny_llama_dir)
    engine.add_request("a", prompt, GREEDY)
    (first,) = engine.step()
    assert first.new_token_ids and engine.pool.num_cached_blocks == 0  # the token left before registration
    engine.flush_commits()
    assert engine.pool.num_cached_blocks == 4  # 3 full blocks and the partial tail
    assert engine.kv.logits.get(engine.kv._final_hash(engine.requests["a"], len(prompt))) is not None
    engine.add_request("b", prompt, GREEDY)
    got = {"a": list(first.new_token_ids)}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert got["a"] == got["b"] == uncached(reference, [prompt])[0]
    assert engine.stats.num_full_hits == 1


def test_a_request_finished_by_a_step_keeps_its_blocks_until_the_flush(tiny_llama_dir: Path) -> None:
    (prompt,) = random_prompts(1024, (3 * BS + 5,), seed=13)
    engine = engine_for(tiny_llama_dir)
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    (out,) = engine.step()
    assert out.finished and "a" not in engine.requests
    assert engine.pool.num_used_blocks == 4 and engine.pool.num_cached_blocks == 0  # the token left first
    engine.flush_commits()
    assert engine.pool.num_used_blocks == 0
    assert engine.pool.num_cached_blocks == 4  # registered before they went back: a later prompt hits them
    engine.add_request("b", prompt, GREEDY)
    engine.step()
    assert engine.stats.num_full_hits == 1


def test_the_next_step_or_a_free_registers_a_prompt_not_yet_flushed(tiny_llama_dir: Path) -> None:
    (prompt,) = random_prompts(1024, (2 * BS + 3,), seed=12)
    engine = engine_for(tiny_llama_dir)
    engine.add_request("a", prompt, GREEDY)
    engine.step()
    engine.add_request("b", prompt, GREEDY)
    engine.step()  # flushes a's prompt first: b is a whole-prompt hit, no forward pass for it
    assert engine.stats.num_full_hits == 1
    engine.add_request("c", prompt[: 2 * BS] + [7, 7, 7], GREEDY)
    engine.step()
    engine.abort("c")  # freed before any flush: its blocks are registered first, so they stay findable
    assert engine.kv._final_hash(engine.requests["a"], 2 * BS) in engine.pool.cached_hashes()
    assert engine.pool.num_cached_blocks == 2 + 1 + 1  # the shared full blocks, a's tail and c's tail


def test_a_deferred_commit_needs_the_prompt_just_computed(tiny_llama_dir: Path) -> None:
    (prompt,) = random_prompts(1024, (BS + 1,), seed=13)
    engine = engine_for(tiny_llama_dir)
    engine.add_request("a", prompt, GREEDY)
    engine.step()
    with pytest.raises(AssertionError):  # a's first token is appended: not its prompt's state any more
        engine.kv.defer_prompt_commit(engine.requests["a"], torch.zeros(8), None)
