"""Requests the engine can never serve raise InvalidRequestError with a message; the engine keeps serving."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.engine import Engine
from pdserve.core.errors import InvalidRequestError
from pdserve.core.sampling_params import SamplingParams

OK = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=64)))


BAD = [
    ("empty", [], OK, "empty"),
    ("too-long", [1] * 512, OK, "context"),
    ("token-too-big", [1, 1024], OK, "vocabulary"),
    ("token-negative", [1, -1], OK, "vocabulary"),
    ("token-beyond-int64", [1, 2**70], OK, "vocabulary"),
    ("token-not-an-integer", [1, "a"], OK, "vocabulary"),
    ("max-tokens-zero", [1], SamplingParams(max_tokens=0), "max_tokens"),
    ("max-tokens-negative", [1], SamplingParams(max_tokens=-3), "max_tokens"),
    ("temperature-negative", [1], SamplingParams(temperature=-0.5), "temperature"),
    ("temperature-nan", [1], SamplingParams(temperature=math.nan), "temperature"),
    ("top-p-zero", [1], SamplingParams(top_p=0.0), "top_p"),
    ("top-p-above-one", [1], SamplingParams(top_p=1.5), "top_p"),
    ("top-p-nan", [1], SamplingParams(top_p=math.nan), "top_p"),
    ("top-k-negative", [1], SamplingParams(top_k=-1), "top_k"),
    ("min-above-max", [1], SamplingParams(max_tokens=2, min_tokens=3), "min_tokens"),
    ("stop-id-outside", [1], SamplingParams(stop_token_ids=(5000,)), "stop token"),
    ("seed-negative", [1], SamplingParams(seed=-1), "seed"),
]


@pytest.mark.parametrize(("prompt", "params", "needle"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_is_refused_with_a_message(engine: Engine, prompt, params, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished()
    assert engine.generate([[1, 2, 3]], OK)[0].__len__() == 4


def test_prompt_larger_than_the_pool_is_refused(tiny_llama_dir: Path) -> None:
    small = Engine(EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=4, block_size=4)))
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        small.add_request("r", list(range(20)), OK)


def test_duplicate_request_id_is_refused(engine: Engine) -> None:
    engine.add_request("dup", [1, 2], OK)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [1, 2], OK)
    engine.abort("dup")
    assert engine.pool.num_used_blocks == 0
