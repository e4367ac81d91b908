"""In-flight dedup: requests whose token ids equal a prompt being prefilled wait for it and take its
whole-prompt hit, so the prompt is computed once; other requests are not held up."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.core.messages import TokenIds
from pdserve.core.request import Request, RequestStatus
from pdserve.core.sampler import SamplingState
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.scheduler import ids_key
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


def test_copies_sent_as_arrays_or_lists_share_one_prefill(tiny_llama_dir: Path) -> None:
    """The dedup key is the ids' int64 bytes: a prompt given as a list, an int64 array or an int32 array (a
    worker's packed ids) is one key; a prompt one token shorter is another."""
    (prompt,) = random_prompts(1024, (45,), seed=74)
    engine = engine_for(tiny_llama_dir)
    copies: list[TokenIds] = [prompt, np.asarray(prompt, np.int64), np.asarray(prompt, np.int32), prompt[:-1]]
    got = engine.generate(copies, GREEDY)
    want = hf_greedy(tiny_llama_dir, [prompt, prompt[:-1]], GREEDY.max_tokens)
    assert got == [want[0]] * 3 + [want[1]]
    assert engine.stats.num_full_hits == 2  # the two array copies; the shorter prompt is computed


def test_the_key_is_the_token_ids_including_generated_ones() -> None:
    state = SamplingState(GREEDY, (), 0)
    a = Request("a", [5, 6, 7], 3, state, token_array=np.asarray([5, 6, 7], dtype=np.int64))
    b = Request("b", [5, 6, 7], 3, state)  # no array: the list's values
    assert ids_key(a) == ids_key(b) == np.asarray([5, 6, 7], dtype=np.int64).tobytes()
    b.token_ids.append(8)  # a token past the array (a resumed request's outputs)
    a2 = Request("a2", [5, 6, 7, 8], 3, state, token_array=np.asarray([5, 6, 7], dtype=np.int64))
    assert ids_key(b) == ids_key(a2) != ids_key(a)
