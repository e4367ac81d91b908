"""Logprobs through the router: validation maps them, the reorderer and merge slice them with their tokens, the
builder returns one per token it returns (a stop string cuts both)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.core.messages import Sampling, TokenEvent, TokenLogprob
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.router.model_info import ModelSpec
from pdserve.router.stream import ResponseBuilder, TokenReorderer, merge
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.validation import RequestValidator, ValidationError


def lp(token: int) -> TokenLogprob:
    """A recognisable entry for token: logprob -token / 100, top [token, token + 1]."""
    return (-token / 100, [token, token + 1], [-token / 100, -token / 100 - 1])


def ev(index: int, *tokens: int, finish: str | None = None) -> TokenEvent:
    return TokenEvent("r", index, list(tokens), finish, logprobs=[lp(t) for t in tokens])


def test_overlapping_events_release_the_logprobs_of_their_new_tokens() -> None:
    r = TokenReorderer()
    out = [
        e
        for event in (ev(0, 10), ev(0, 10, 11), ev(1, 11, 12, 13), ev(3, 13, 14, finish="stop"))
        for e in r.push(event)
    ]
    assert [e.token_ids for e in out] == [[10], [11], [12, 13], [14]]
    assert [e.logprobs for e in out] == [[lp(10)], [lp(11)], [lp(12), lp(13)], [lp(14)]]


def test_merge_keeps_one_entry_per_token() -> None:
    assert merge([ev(0, 10), ev(1, 11, 12)]).logprobs == [lp(10), lp(11), lp(12)]
    plain = [TokenEvent("r", 0, [10]), TokenEvent("r", 1, [11])]
    assert merge(plain).logprobs is None
    finish = TokenEvent("r", 2, [], "abort")  # an empty finish marker carries none
    assert merge([ev(0, 10), ev(1, 11), finish]).logprobs == [lp(10), lp(11)]


def builder(tokenizer: RouterTokenizer, stop: tuple[str, ...] = (), logprobs: bool = True) -> ResponseBuilder:
    sampling = Sampling(logprobs=logprobs, top_logprobs=2)
    return ResponseBuilder("r", tokenizer.encode("Say:"), sampling, stop, tokenizer, arrival=0.0)


def as_tuples(response: pb.GenerateResponse) -> list[TokenLogprob]:
    return [(e.logprob, [t.token_id for t in e.top], [t.logprob for t in e.top]) for e in response.logprobs]


def test_responses_carry_one_logprobs_entry_per_token(tokenizer: RouterTokenizer) -> None:
    ids = tokenizer.encode(" one two three")
    response = builder(tokenizer).build(ev(0, *ids), 0.0)
    assert list(response.token_ids) == ids
    want = [(pytest.approx(c), i, pytest.approx(v)) for c, i, v in (lp(t) for t in ids)]  # NOTE: float32 on the wire
    assert as_tuples(response) == want


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(tokenizer: RouterTokenizer) -> None:
    ids = tokenizer.encode(" one two three four")
    b = builder(tokenizer, stop=("three",))
    response = b.build(ev(0, *ids), 0.0)
    assert len(response.logprobs) == len(response.token_ids) < len(ids)
    assert [e.logprob for e in response.logprobs] == pytest.approx([lp(t)[0] for t in response.token_ids])


def test_no_logprobs_unless_asked(tokenizer: RouterTokenizer) -> None:
    ids = tokenizer.encode(" one two")
    assert not builder(tokenizer, logprobs=False).build(ev(0, *ids), 0.0).logprobs


@pytest.fixture(scope="module")
def validator(smollm2_dir: Path, tokenizer: RouterTokenizer) -> RequestValidator:
    return RequestValidator(ModelSpec.from_dir(smollm2_dir), tokenizer)


def request(**sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(**sampling))


def test_validation_maps_logprobs_into_sampling(validator: RequestValidator) -> None:
    sampling = validator.validate(request(logprobs=True, top_logprobs=20)).sampling
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 20)
    off = validator.validate(request()).sampling
    assert (off.logprobs, off.top_logprobs) == (False, 0)


@pytest.mark.parametrize(
    ("sampling", "message"),
    [({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in"), ({"top_logprobs": 3}, "needs logprobs")],
)
def test_validation_refuses_bad_logprobs(validator: RequestValidator, sampling: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        validator.validate(request(**sampling))
