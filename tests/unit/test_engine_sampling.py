"""Sampling through the engine: seeds reproduce whatever the batch, stop ids, min_tokens, max_model_len."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.engine import Engine
from pdserve.core.sampling_params import SamplingParams
from tests.hf_reference import random_prompts


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=128)))


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[list[int], str | None]]:
    ids = [f"s{i}-{len(engine.requests)}-{id(params)}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return [(tokens[rid], reasons[rid]) for rid in ids]


def test_seeded_request_is_reproducible_in_any_batch(engine: Engine) -> None:
    (prompt, *others) = random_prompts(1024, (9, 4, 30, 12), seed=21)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    noisy = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    alone = run(engine, [prompt], [seeded])[0]
    crowded = run(engine, [*others, prompt], [noisy, noisy, noisy, seeded])[-1]
    assert alone == crowded
    other_seed = run(engine, [prompt], [SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=20)])[0]
    assert other_seed[0] != alone[0]


def test_stop_token_ids_and_min_tokens(engine: Engine) -> None:
    (prompt,) = random_prompts(1024, (11,), seed=22)
    greedy = run(engine, [prompt], [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)])[0][0]
    stop_at = greedy[5]
    first = greedy.index(stop_at)
    stopped, reason = run(
        engine, [prompt], [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop_at,))]
    )[0]
    assert reason == "stop" and stopped == greedy[: first + 1]
    # min_tokens masks the stop id, so the output can no longer contain it among its first min_tokens tokens
    held, _ = run(
        engine,
        [prompt],
        [SamplingParams(temperature=0.0, max_tokens=30, min_tokens=first + 2, stop_token_ids=(stop_at,))],
    )[0]
    assert stop_at not in held[: first + 1] and len(held) >= first + 2


def test_length_at_max_tokens_and_at_the_context_end(engine: Engine) -> None:
    out, reason = run(engine, [[5, 6]], [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)])[0]
    assert (len(out), reason) == (7, "length")
    max_len = engine.config.model.max_model_len
    out, reason = run(engine, [[5] * (max_len - 3)], [SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)])[
        0
    ]
    assert (len(out), reason) == (3, "length")
    assert engine.pool.num_used_blocks == 0


def test_eos_stops_unless_ignored(tiny_llama_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(tiny_llama_dir)
    (prompt,) = random_prompts(1024, (6,), seed=23)
    greedy = Engine(EngineConfig(cfg, CacheConfig(num_blocks=64))).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    )[0]
    from dataclasses import replace

    eos_engine = Engine(EngineConfig(replace(cfg, eos_token_ids=(greedy[3],)), CacheConfig(num_blocks=64)))
    stopped = eos_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert stopped == greedy[: greedy.index(greedy[3]) + 1]
    kept = eos_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    assert kept == greedy
