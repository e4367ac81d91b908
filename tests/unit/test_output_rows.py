"""A prefill pass runs its last layer on its sampling rows alone: same logits, same K/V cached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from tests.hf_reference import random_prompts
from tests.passes import every_row_logits, prompt_plan

LENGTHS = (37, 50, 5, 16)
CHUNKS = (37, 20, 5, 16)
"""The second prompt's chunk stops short of its end: it does not sample."""


def make_engine(model_dir: Path) -> Engine:
    cfg = EngineConfig(ModelConfig.from_pretrained(model_dir), CacheConfig(num_blocks=64), SchedulerConfig())
    return Engine(cfg)


def last_mlp(engine: Engine) -> torch.nn.Module:
    model: Any = engine.runner.model
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    return layers[-1].mlp  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_last_layer_runs_on_the_sampling_rows_alone(family: str, request: pytest.FixtureRequest) -> None:
    engine = make_engine(request.getfixturevalue(f"tiny_{family}_dir"))
    prompts = random_prompts(engine.config.model.vocab_size, LENGTHS, seed=3)
    plan = prompt_plan(engine, prompts, CHUNKS)
    seen: list[int] = []
    last_mlp(engine).register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
    rows = engine.runner.execute(plan)
    assert seen == [3] and rows.shape[0] == 3
    torch.testing.assert_close(rows, every_row_logits(engine.runner, plan), rtol=1e-5, atol=1e-5)
    assert seen == [3, sum(CHUNKS)]  # NOTE: the reference did run the last layer on every token


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_last_layer_caches_every_tokens_kv(family: str, request: pytest.FixtureRequest) -> None:
    engine = make_engine(request.getfixturevalue(f"tiny_{family}_dir"))
    prompts = random_prompts(engine.config.model.vocab_size, LENGTHS, seed=4)
    plan = prompt_plan(engine, prompts, CHUNKS)
    pools = []
    for run in (engine.runner.execute, lambda p: every_row_logits(engine.runner, p)):
        engine.runner.kv_pool.zero_()
        run(plan)
        pools.append(engine.runner.kv_pool.clone())
    assert pools[0][-1].abs().sum() > 0  # the last layer's K/V were written
    assert torch.equal(pools[0], pools[1])


def test_pass_without_sampling_rows_caches_kv_and_returns_no_logits(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    (prompt,) = random_prompts(engine.config.model.vocab_size, (40,), seed=5)
    engine.runner.kv_pool.zero_()
    logits = engine.runner.execute(prompt_plan(engine, [prompt], [24]))
    assert logits.shape == (0, engine.config.model.vocab_size)
    written = engine.runner.kv_pool[-1, 0].flatten(1).abs().sum(1)  # [num_blocks] of the last layer's K
    assert (written > 0).sum() == 2  # 24 tokens: one full block and half of the next
