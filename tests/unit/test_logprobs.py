"""Logprobs: the sampler's against torch.log_softmax, request validation, the wire form, and the engine's against
transformers on every path that samples (prefill, overlapped decode steps, an exact prefix hit)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import torch

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.engine import Engine, InFlightStep, RequestOutput
from pdserve.core.errors import InvalidRequestError
from pdserve.core.messages import (
    PROTOCOL_VERSION,
    MessageError,
    Sampling,
    TokenBatchEvent,
    TokenEvent,
    decode,
    encode,
)
from pdserve.core.sampler import HostLogprobs, Sampler, SamplingState, token_logprobs
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.scheduler import StepPlan
from tests.hf_reference import random_prompts
from tests.logprobs_reference import assert_outputs_match, run_requests

EOS = 3
VOCAB = 64


def _state(**kw: object) -> SamplingState:
    return SamplingState(SamplingParams(**kw), (EOS,), 0)  # type: ignore[arg-type]


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3  # [batch, VOCAB]


def _reference(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, k: int) -> tuple[float, list[int]]:
    """(logprob of the token, top-k ids) of one row, from torch.log_softmax(logits / T)."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return float(logp[tokens]), logp.topk(k).indices.tolist() if k else []


# --- the sampler ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top", [0, 1, 5, 20])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_log_softmax_of_the_logits_after_temperature(temperature: float, top: int) -> None:
    logits = _logits(4)
    states = [_state(temperature=temperature, seed=i, logprobs=True, top_logprobs=top) for i in range(4)]
    tokens = Sampler(seed=0).sample(logits, states)
    got = token_logprobs(logits, states, tokens)
    assert got is not None and got.rows == [0, 1, 2, 3] and got.num_top == [top] * 4
    entries = got.entries(4)
    scale = temperature or 1.0  # NOTE: greedy counts as temperature 1
    for row, entry in enumerate(entries):
        assert entry is not None
        chosen, ids, top_logprobs = entry
        want_chosen, want_ids = _reference(logits[row], tokens[row], scale, top)
        assert chosen == pytest.approx(want_chosen, abs=1e-5)
        assert ids == want_ids and len(top_logprobs) == top
        want_top = torch.log_softmax(logits[row].double() / scale, dim=-1)[want_ids].tolist() if top else []
        assert top_logprobs == pytest.approx(want_top, abs=1e-5)
        assert top_logprobs == sorted(top_logprobs, reverse=True)


def test_a_mixed_batch_gives_logprobs_only_to_the_rows_that_asked() -> None:
    logits = _logits(5, seed=1)
    states = [
        _state(temperature=0.0),
        _state(temperature=0.0, logprobs=True, top_logprobs=3),
        _state(temperature=1.3, seed=7),
        _state(temperature=0.5, top_k=4, top_p=0.5, seed=8, logprobs=True, top_logprobs=20),
        _state(temperature=0.9, seed=9, logprobs=True),
    ]
    tokens = Sampler(seed=0).sample(logits, states)
    got = token_logprobs(logits, states, tokens)
    assert got is not None
    entries = got.entries(5)
    assert entries[0] is None and entries[2] is None
    for row, temperature, top in ((1, 1.0, 3), (3, 0.5, 20), (4, 0.9, 0)):
        entry = entries[row]
        assert entry is not None
        want_chosen, want_ids = _reference(logits[row], tokens[row], temperature, top)
        # NOTE: before top-k / top-p: row 3's top 20 reach far outside the 4 tokens it may sample
        assert entry[0] == pytest.approx(want_chosen, abs=1e-5) and entry[1] == want_ids and len(entry[2]) == top


def test_no_row_asking_runs_nothing() -> None:
    logits = _logits(3)
    states = [_state(temperature=0.0) for _ in range(3)]
    assert token_logprobs(logits, states, Sampler(seed=0).sample(logits, states)) is None


def test_below_min_tokens_the_stop_ids_are_masked_out_of_the_distribution() -> None:
    logits = _logits(1, seed=2)
    logits[0, EOS] = 50.0  # the argmax, but masked until one token exists
    states = [_state(temperature=0.0, min_tokens=1, logprobs=True, top_logprobs=2)]
    tokens = Sampler(seed=0).sample(logits, states)
    got = token_logprobs(logits, states, tokens)
    assert got is not None
    ((chosen, ids, _top),) = got.entries(1)  # type: ignore[misc]
    masked = logits[0].clone()
    masked[EOS] = float("-inf")
    assert chosen == pytest.approx(float(torch.log_softmax(masked, -1).max()), abs=1e-5)
    assert EOS not in ids and ids[0] == int(tokens[0])


def test_host_copies_alternate_so_the_unread_step_keeps_its_values() -> None:
    logits = _logits(2, seed=3)
    states = [_state(temperature=0.0, logprobs=True, top_logprobs=2) for _ in range(2)]
    tokens = Sampler(seed=0).sample(logits, states)
    lp = token_logprobs(logits, states, tokens)
    assert lp is not None
    host = HostLogprobs(4, pin=False)
    first = host.copy(lp)
    second = host.copy(lp._replace(chosen=lp.chosen - 1.0))
    assert first.entries(2) == lp.entries(2)
    assert [e[0] for e in second.entries(2) if e] == [e[0] - 1.0 for e in lp.entries(2) if e]


# --- validation and the wire ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs must be in [0, 20]"),
        ({"top_logprobs": 5}, "top_logprobs needs logprobs"),
    ],
)
def test_bad_logprobs_params_are_refused(kw: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kw).validate(VOCAB)  # type: ignore[arg-type]


def test_logprobs_params_travel_in_sampling() -> None:
    params = SamplingParams(logprobs=True, top_logprobs=7)
    sampling = Sampling.of(params, 3)
    assert (sampling.logprobs, sampling.top_logprobs, sampling.num_generated) == (True, 7, 3)
    assert sampling.params == params and type(sampling.params) is SamplingParams


def test_token_logprobs_round_trip_in_a_token_batch() -> None:
    event = TokenEvent("r", 2, [5, 6], None, logprobs=[(-0.5, [5, 1], [-0.5, -1.5]), (-0.25, [], [])])
    assert decode(encode(TokenBatchEvent([event]))) == TokenBatchEvent([event])
    assert decode(encode(TokenEvent("r", 0, [5]))) == TokenEvent("r", 0, [5])


@pytest.mark.parametrize(
    "logprobs",
    [
        [[-0.5, [], []]],  # one entry for two tokens
        [[-0.5, [], []], [-0.5, [1], []]],  # ids and logprobs of different lengths
        [[-0.5, [], []], ["x", [], []]],
        [[-0.5, [], []], [-0.5, [1.5], [-1.0]]],
        [[-0.5, [], []], [-0.5, list(range(21)), [-1.0] * 21]],
        "not a list",
    ],
)
def test_malformed_token_logprobs_are_a_message_error(logprobs: object) -> None:
    fields = {"request_id": "r", "index": 0, "token_ids": [5, 6], "logprobs": logprobs}
    with pytest.raises(MessageError, match="logprobs"):
        decode(msgpack.packb([PROTOCOL_VERSION, "tokens", fields]))


def test_sampling_without_the_new_fields_decodes_with_logprobs_off() -> None:
    fields = {"request_id": "r", "token_ids": b"", "sampling": {"temperature": 0.0}, "decode_worker": 0}
    msg = decode(msgpack.packb([PROTOCOL_VERSION, "generate", fields], use_bin_type=True))
    assert msg.sampling == Sampling(temperature=0.0)  # type: ignore[union-attr]


# --- the engine against transformers --------------------------------------------------------------------------

TOP = 5
ASKING = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=TOP)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=128)))


def check_against_hf(model_dir: Path, prompt: list[int], outs: list[RequestOutput], temperature: float = 1.0) -> None:
    assert_outputs_match(model_dir, prompt, outs, TOP, temperature)


def test_engine_logprobs_match_hf_on_every_path(
    engine: Engine, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = random_prompts(1024, (21, 40), seed=61)
    launched: list[StepPlan] = []
    launch = engine._launch_decode

    def counting_launch(plan: StepPlan) -> InFlightStep:
        launched.append(plan)
        return launch(plan)

    monkeypatch.setattr(engine, "_launch_decode", counting_launch)
    # a batch where one row asks: prefill, then decode steps that overlap the host (outputs one step late)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first, other = run_requests(engine, [a, b], [ASKING, plain])
    assert launched and all(o.logprobs is None for o in other)
    check_against_hf(tiny_llama_dir, a, first)
    # seeded sampling (steps in order): the sampled token's logprob after temperature
    seeded = SamplingParams(temperature=0.7, seed=5, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=TOP)
    (random_row,) = run_requests(engine, [b], [seeded])
    check_against_hf(tiny_llama_dir, b, random_row, temperature=0.7)
    # the same prompt again: an exact hit samples the cached logits row, no forward pass for its first token
    hits = engine.stats.num_full_hits
    (again,) = run_requests(engine, [a], [ASKING])
    assert engine.stats.num_full_hits == hits + 1
    check_against_hf(tiny_llama_dir, a, again)
