"""router.stream: TokenEvents reordered by index without duplicates; responses with text, stop strings, usage."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.core.messages import Sampling, Timings, TokenEvent
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.router.stream import ResponseBuilder, TokenReorderer, merge
from pdserve.router.tokenizer import RouterTokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> RouterTokenizer:
    return RouterTokenizer.from_dir(smollm2_dir)


def ev(index: int, *tokens: int, finish: str | None = None) -> TokenEvent:
    return TokenEvent("r", index, list(tokens), finish)


def released(reorderer: TokenReorderer, *events: TokenEvent) -> list[tuple[int, list[int], str | None]]:
    return [(e.index, e.token_ids, e.finish_reason) for event in events for e in reorderer.push(event)]


def test_out_of_order_events_come_out_in_index_order() -> None:
    r = TokenReorderer()
    assert released(r, ev(2, 12), ev(3, 13, 14)) == []
    assert released(r, ev(0, 10)) == [(0, [10], None)]
    assert released(r, ev(6, 16, finish="length"), ev(1, 11)) == [(1, [11], None), (2, [12], None), (3, [13, 14], None)]
    assert released(r, ev(4, 14)) == []  # index 4 was already covered by the two-token event
    assert r.next_index == 5 and released(r, ev(5, 15)) == [(5, [15], None), (6, [16], "length")]


def test_duplicates_and_overlaps_never_repeat_a_token() -> None:
    r = TokenReorderer()
    got = released(r, ev(0, 10), ev(0, 10), ev(1, 11, 12), ev(2, 12, 13), ev(1, 11), ev(4, 14, finish="stop"))
    assert got == [(0, [10], None), (1, [11, 12], None), (3, [13], None), (4, [14], "stop")]
    assert released(r, ev(5, 15)) == []  # nothing after the finish


def test_an_empty_finish_event_ends_the_stream_at_its_index() -> None:
    r = TokenReorderer()
    assert released(r, ev(1, finish="abort"), ev(0, 10)) == [(0, [10], None), (1, [], "abort")]


def builder(tokenizer: RouterTokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0) -> ResponseBuilder:
    prompt = tokenizer.encode("Say something:")
    return ResponseBuilder("r", prompt, Sampling(min_tokens=min_tokens), stop, tokenizer, arrival=100.0)


def test_last_response_carries_finish_usage_and_timings(tokenizer: RouterTokenizer) -> None:
    ids = tokenizer.encode(" Hi 👋 there")
    b = builder(tokenizer)
    timings = Timings(arrival=100.0, prefill_start=100.010, prefill_end=100.050, first_token=100.050)
    first = TokenEvent("r", 0, ids[:1], None, 3, 2, timings)
    responses = [b.build(first, 100.06)]
    responses += [b.build(TokenEvent("r", i, [t]), 100.07 + i) for i, t in enumerate(ids[1:-1], 1)]
    responses.append(b.build(TokenEvent("r", len(ids) - 1, ids[-1:], "length"), 200.0))
    assert "".join(r.text for r in responses) == " Hi 👋 there"
    assert [t for r in responses for t in r.token_ids] == ids
    last = responses[-1]
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and b.worker_finished
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_prompt_tokens) == (
        len(tokenizer.encode("Say something:")), len(ids), 2,
    )  # fmt: skip
    assert last.timings.queue_ms == pytest.approx(10.0)
    assert last.timings.prefill_ms == pytest.approx(40.0)
    assert last.timings.first_token_ms == pytest.approx(50.0)
    assert last.timings.handoff_ms == pytest.approx((101.07 - 100.05) * 1000)


def test_stop_string_across_tokens_ends_the_stream_without_it(tokenizer: RouterTokenizer) -> None:
    ids = tokenizer.encode("one two\n\nUser: three four")
    b = builder(tokenizer, stop=("\n\nUser:",))
    responses = []
    for i, t in enumerate(ids):
        responses.append(b.build(TokenEvent("r", i, [t]), 0.0))
        if b.finished:
            break
    assert "".join(r.text for r in responses) == "one two"
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP and not b.worker_finished
    assert responses[-1].usage.completion_tokens == len(responses) < len(ids)


def test_stop_string_inside_one_event_drops_the_tokens_after_it(tokenizer: RouterTokenizer) -> None:
    ids = tokenizer.encode("alpha STOP beta gamma")
    response = builder(tokenizer, stop=("STOP",)).build(TokenEvent("r", 0, ids), 0.0)
    assert response.text == "alpha " and response.finish_reason == pb.FINISH_REASON_STOP
    assert len(response.token_ids) < len(ids) and tokenizer.decode(response.token_ids).endswith("STOP")


def test_stop_strings_wait_for_min_tokens(tokenizer: RouterTokenizer) -> None:
    ids = tokenizer.encode("x x x x")
    b = builder(tokenizer, stop=("x",), min_tokens=2)
    texts = [b.build(TokenEvent("r", i, [t]), 0.0).text for i, t in enumerate(ids[:3])]
    assert texts == ["x", " x", " "] and b.finish_reason == pb.FINISH_REASON_STOP


def test_events_that_arrive_together_merge_into_one_in_order_event() -> None:
    r = TokenReorderer()
    timed = TokenEvent("r", 0, [10], None, 7, 3, Timings(arrival=1.0, first_token=2.0))
    ready = [e for event in (ev(2, 12, 13), timed, ev(1, 11), ev(4, 14, finish="length")) for e in r.push(event)]
    one = merge(ready)
    assert (one.index, one.token_ids, one.finish_reason) == (0, [10, 11, 12, 13, 14], "length")
    assert (one.num_prompt_tokens, one.num_cached_tokens, one.timings) == (7, 3, timed.timings)
    assert merge([timed]) is timed
