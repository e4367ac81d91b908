"""Request migration at the engine: a request resumed as prompt + its tokens so far (num_generated) carries
on exactly where it stopped: the same greedy and seeded tokens, output indexes and finish as one that ran
uninterrupted."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.core.engine import Engine
from pdserve.core.errors import InvalidRequestError
from pdserve.core.sampling_params import SamplingParams
from tests.hf_reference import random_prompts
from tests.unit.test_engine_matches_hf import make_engine

NEW_TOKENS = 24


def run(engine: Engine, request_id: str, tokens: list[int], params: SamplingParams, num_generated: int = 0):
    """(new tokens in order, index of the first output, finish reason) of one request run to completion."""
    engine.add_request(request_id, tokens, params, num_generated)
    got: list[int] = []
    first_index, reason = None, None
    while engine.has_unfinished():
        for out in engine.step():
            if first_index is None:
                first_index = out.num_output_tokens - len(out.new_token_ids)
            got += out.new_token_ids
            reason = out.finish_reason
    return got, first_index, reason


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS - 2, ignore_eos=True),
    ],
    ids=["greedy", "seeded", "min-tokens"],
)
@pytest.mark.parametrize("cut", [1, 9, NEW_TOKENS - 1])
def test_resumed_request_continues_exactly(tiny_llama_dir: Path, params: SamplingParams, cut: int) -> None:
    engine = make_engine(tiny_llama_dir)
    (prompt,) = random_prompts(engine.config.model.vocab_size, [21], seed=4)
    whole, index, reason = run(engine, "whole", prompt, params)
    assert (len(whole), index, reason) == (NEW_TOKENS, 0, "length")
    rest, index, reason = run(make_engine(tiny_llama_dir), "resumed", prompt + whole[:cut], params, cut)
    assert rest == whole[cut:] and index == cut and reason == "length"


def test_resume_counts_are_checked(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for num_generated in (-1, 3, 4):  # no prompt left; as many as max_tokens
        with pytest.raises(InvalidRequestError, match="num_generated"):
            engine.add_request(f"r{num_generated}", [1, 2, 3], params, num_generated)
    assert not engine.has_unfinished()
