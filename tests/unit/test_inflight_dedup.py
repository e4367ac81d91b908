"""In-flight dedup: requests whose token ids equal a prompt being prefilled wait for it and take its
whole-prompt hit, so the prompt is computed once; other requests are not held up."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from core.engine import Engine
from core.request import RequestStatus
from core.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def engine_for(model_dir: Path, caching: bool = True, chunk: int | None = None) -> Engine:
    cache = CacheConfig(block_size=16, num_blocks=128, enable_prefix_caching=caching)
    sched = SchedulerConfig(max_num_seqs=8, prefill_chunk_size=chunk)
    return Engine(EngineConfig(ModelConfig.from_pretrained(model_dir), cache, sched))


@pytest.mark.parametrize("chunk", [None, 16], ids=["one-pass", "chunked"])
def test_three_identical_prompts_in_flight_are_prefilled_once(tiny_llama_dir: Path, chunk: int | None) -> None:
    (prompt,) = random_prompts(1024, (53,), seed=71)
    engine = engine_for(tiny_llama_dir, chunk=chunk)
    got = engine.generate([prompt, list(prompt), list(prompt)], GREEDY)
    assert got == hf_greedy(tiny_llama_dir, [prompt], GREEDY.max_tokens) * 3
    assert engine.stats.num_prefill_tokens_computed == len(prompt)
    assert engine.stats.num_full_hits == 2
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1


def test_without_prefix_caching_every_copy_is_computed(tiny_llama_dir: Path) -> None:
    (prompt,) = random_prompts(1024, (40,), seed=72)
    engine = engine_for(tiny_llama_dir, caching=False)
    engine.generate([prompt, list(prompt), list(prompt)], GREEDY)
    assert engine.stats.num_prefill_tokens_computed == 3 * len(prompt)


def test_a_held_copy_does_not_hold_up_the_requests_behind_it(tiny_llama_dir: Path) -> None:
    a, b = random_prompts(1024, (70, 9), seed=73)
    engine = engine_for(tiny_llama_dir, chunk=16)
    for rid, prompt in (("a", a), ("a-copy", list(a)), ("b", b)):
        engine.add_request(rid, prompt, GREEDY)
    engine.step()
    status = {rid: engine.requests[rid].status for rid in ("a", "a-copy", "b")}
    assert status == {"a": RequestStatus.RUNNING, "a-copy": RequestStatus.WAITING, "b": RequestStatus.RUNNING}
    assert [r.request_id for r in engine.scheduler.waiting] == ["a-copy"]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.num_prefill_tokens_computed == len(a) + len(b) and engine.stats.num_full_hits == 1
