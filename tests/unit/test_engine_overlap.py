"""Decode steps that overlap the host with the device: tokens read one step late, nothing lost or leaked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.engine import PLACEHOLDER, Engine, RequestOutput
from pdserve.core.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture()
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=96)))


def drain(engine: Engine) -> list[RequestOutput]:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_decode_steps_overlap_and_outputs_arrive_one_step_later(engine: Engine) -> None:
    prompts = random_prompts(1024, (5, 9), seed=31)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    first = engine.step()  # the prefill pass: runs in order, its tokens come back at once
    assert [len(o.new_token_ids) for o in first] == [1, 1]
    # NOTE: the first decode pass copies the prompt's cached partial tail block (copy-on-write): in order too
    second = engine.step()
    assert [o.num_output_tokens for o in second] == [2, 2] and engine._in_flight is None
    assert engine.step() == []  # a pure decode pass: launched, nothing read yet
    req = engine.requests["r0"]
    assert req.token_ids[-1] == PLACEHOLDER and req.num_computed_tokens == len(req.token_ids) - 1
    third = engine.step()  # launches the next pass, then reads the previous one
    assert [o.request_id for o in third] == ["r0", "r1"] and all(o.num_output_tokens == 3 for o in third)
    assert req.token_ids[-1] == PLACEHOLDER and PLACEHOLDER not in req.token_ids[:-1]
    outs = first + second + third + drain(engine)
    streamed = {f"r{i}": [t for o in outs if o.request_id == f"r{i}" for t in o.new_token_ids] for i in range(2)}
    assert list(streamed.values()) == hf_greedy(engine.config.model.path, prompts, GREEDY.max_tokens)
    counts = [o.num_output_tokens for o in outs if o.request_id == "r0"]
    assert counts == list(range(1, GREEDY.max_tokens + 1))
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1


def test_a_request_that_stops_drops_the_token_of_the_step_already_launched(engine: Engine) -> None:
    (prompt,) = random_prompts(1024, (7,), seed=32)
    expected = hf_greedy(engine.config.model.path, [prompt], 20)[0]
    stop_at = expected[6]
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop_at,), ignore_eos=True)
    engine.add_request("s", prompt, params)
    outs = drain(engine)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == expected[: expected.index(stop_at) + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and sum(o.finished for o in outs) == 1
    assert engine.num_forward_calls == len(tokens) + 1  # one decode step ran past the stop; its token dropped
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1


def test_abort_while_a_step_is_in_flight_returns_every_block(engine: Engine) -> None:
    prompts = random_prompts(1024, (20, 33, 4), seed=33)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"a{i}", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    aborted = engine.abort("a1")
    assert aborted is not None and aborted.finish_reason == "abort"
    outs = drain(engine)
    assert not any(o.request_id == "a1" for o in outs)
    assert sum(o.finished for o in outs) == 2
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1


def test_a_new_request_joins_while_decoding_and_every_stream_matches_hf(engine: Engine) -> None:
    prompts = random_prompts(1024, (6, 11, 17), seed=34)
    engine.add_request("j0", prompts[0], GREEDY)
    engine.add_request("j1", prompts[1], GREEDY)
    outs = [o for _ in range(5) for o in engine.step()]
    assert engine._in_flight is not None
    engine.add_request("j2", prompts[2], GREEDY)  # a prefill pass: reads the in-flight step first
    outs += drain(engine)
    streams = [[t for o in outs if o.request_id == f"j{i}" for t in o.new_token_ids] for i in range(3)]
    assert streams == hf_greedy(engine.config.model.path, prompts, GREEDY.max_tokens)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1


def test_a_long_prompt_joining_decodes_in_a_mixed_pass(engine: Engine) -> None:
    """A pass that mixes a prompt with decoding requests reads token lists (not arrays)."""
    prompts = random_prompts(1024, (6, 11, 100), seed=35)
    engine.add_request("m0", prompts[0], GREEDY)
    engine.add_request("m1", prompts[1], GREEDY)
    outs = [o for _ in range(4) for o in engine.step()]
    engine.add_request("m2", prompts[2], GREEDY)
    outs += engine.step()  # decode chunks of m0, m1 and m2's prompt in one pass
    outs += drain(engine)
    streams = [[t for o in outs if o.request_id == f"m{i}" for t in o.new_token_ids] for i in range(3)]
    assert streams == hf_greedy(engine.config.model.path, prompts, GREEDY.max_tokens)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1


def test_a_long_prompt_left_with_one_token_to_compute_reads_its_ids(engine: Engine) -> None:
    """A prefix hit on all but the last token leaves a one-token pass: a decode pass, which reads token_ids."""
    bs = engine.config.cache.block_size
    (first,) = random_prompts(1024, (-(-64 // bs) * bs + 1,), seed=37)
    engine.generate([first], GREEDY)
    second = [*first[:-1], first[-1] % 1023 + 1]  # another last token (never 0, the placeholder)
    computed_before = engine.stats.num_prefill_tokens_computed
    got = engine.generate([second], GREEDY)
    assert engine.stats.num_prefill_tokens_computed - computed_before == 1
    assert got == hf_greedy(engine.config.model.path, [second], GREEDY.max_tokens)


def test_a_prompt_given_as_an_array_gets_a_list_of_python_ints(engine: Engine) -> None:
    (prompt,) = random_prompts(1024, (64,), seed=36)
    engine.add_request("a", np.array(prompt, dtype=np.int32), GREEDY)
    req = engine.requests["a"]
    assert req.token_ids == prompt and all(type(t) is int for t in req.token_ids)
    assert np.array_equal(req.tokens(0, len(prompt)), prompt)
    drain(engine)


def test_seeded_sampling_runs_in_order_so_its_state_counts_every_token(engine: Engine) -> None:
    (prompt,) = random_prompts(1024, (8,), seed=35)
    engine.add_request("seeded", prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=6))
    engine.step()
    engine.step()
    assert engine._in_flight is None  # not overlapped: the seed of a step depends on the tokens read so far
    drain(engine)


def test_warmup_passes_touch_only_the_null_block_and_leave_no_trace(engine: Engine) -> None:
    free, cached = engine.pool.num_free_blocks, dict(engine.requests)
    engine.runner.warmup(lengths=(1, 7, 40))
    assert engine.num_forward_calls == 0 and engine.pool.num_free_blocks == free and engine.requests == cached
    test_decode_steps_overlap_and_outputs_arrive_one_step_later(engine)  # serving afterwards is unchanged


def test_a_one_token_prompt_gets_its_first_token_from_the_step_that_computed_it(engine: Engine) -> None:
    # NOTE: its pass looks like a decode pass; overlapped, the token came a step late and a second pass of the
    # request had already run by then: a prefill worker, which detaches each request on its first token, saw
    # two outputs of one request and crashed (H200, tests/gpu/test_cluster_cuda.py)
    engine.add_request("one", [7], GREEDY)
    (first,) = engine.step()
    assert (first.request_id, first.num_output_tokens, engine._in_flight) == ("one", 1, None)
    for i, prompt in enumerate(random_prompts(1024, (5, 9), seed=32)):
        engine.add_request(f"late{i}", prompt, GREEDY)
    outs = engine.step()  # "one" decodes beside two prompts: one output each, in order
    assert sorted(o.request_id for o in outs) == ["late0", "late1", "one"]
    assert [o.num_output_tokens for o in outs if o.request_id == "one"] == [2]
    drain(engine)
    assert engine.pool.num_used_blocks == 0
