"""One request's output: TokenEvents from two workers put in order, then turned into GenerateResponses with
text deltas, stop strings, usage and timings."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from pdserve.core.messages import Sampling, Timings, TokenEvent, TokenIds, TokenLogprob
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.router.tokenizer import RouterTokenizer, StopStringMatcher

FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class TokenReorderer:
    """Orders one request's TokenEvents by `index` (the prefill worker sends index 0, the decode worker the
    rest, on different paths): each token comes out exactly once, in order; duplicates are dropped."""

    def __init__(self) -> None:
        self.next_index = 0
        self.pending: dict[int, TokenEvent] = {}
        self.finished = False

    def push(self, event: TokenEvent) -> list[TokenEvent]:
        """The events (trimmed to their new tokens) that are now in order; [] while a gap remains."""
        if self.finished or event.index + len(event.token_ids) < self.next_index:
            return []
        out: list[TokenEvent] = []
        if event.index == self.next_index and not self.pending:  # NOTE: the common case: nothing to reorder
            self._release(event, out)
            return out
        held = self.pending.get(event.index)
        if held is None or len(event.token_ids) > len(held.token_ids):
            self.pending[event.index] = event
        while not self.finished:
            ready = sorted(i for i in self.pending if i <= self.next_index)
            if not ready:
                break
            for index in ready:
                self._release(self.pending.pop(index), out)
        return out

    def _release(self, event: TokenEvent, out: list[TokenEvent]) -> None:
        if self.finished:
            return
        skip = self.next_index - event.index
        new = event.token_ids[skip:]
        # NOTE: an event with no tokens is only meaningful as a finish marker at the current index.
        if new or (skip == 0 and event.finish_reason is not None):
            out.append(event if skip == 0 else _skip(event, skip))
            self.next_index += len(new)
            self.finished = event.finish_reason is not None


def _skip(event: TokenEvent, skip: int) -> TokenEvent:
    """event without its first skip tokens (and their logprobs)."""
    logprobs = None if event.logprobs is None else event.logprobs[skip:]
    return dataclasses.replace(event, index=event.index + skip, token_ids=event.token_ids[skip:], logprobs=logprobs)


def merge(events: Sequence[TokenEvent]) -> TokenEvent:
    """Consecutive in-order events (TokenReorderer output) as one: the tokens of all, the last finish reason,
    the latest timings, the logprobs of all (None when no event has any). The router sends one response per
    merge, so a stream whose client or router is behind catches up with fewer, larger responses."""
    if len(events) == 1:
        return events[0]
    timings = next((e.timings for e in reversed(events) if e.timings is not None), None)
    logprobs = None
    if any(e.logprobs is not None for e in events):
        logprobs = [lp for e in events for lp in _logprobs_of(e)]
    return TokenEvent(
        events[0].request_id,
        events[0].index,
        [t for e in events for t in e.token_ids],
        events[-1].finish_reason,
        max(e.num_prompt_tokens for e in events),
        max(e.num_cached_tokens for e in events),
        timings,
        logprobs,
    )


def _logprobs_of(event: TokenEvent) -> list[TokenLogprob]:
    """event.logprobs; NaN entries for tokens without (never from a worker that was asked: it keeps the merged
    list one entry per token)."""
    if event.logprobs is not None:
        return event.logprobs
    return [_MISSING] * len(event.token_ids)


_MISSING: TokenLogprob = (math.nan, [], [])


class ResponseBuilder:
    """Turns in-order TokenEvents into responses: text deltas, stop strings, and on the last one the finish
    reason, usage and timings."""

    def __init__(
        self, request_id: str, prompt_ids: TokenIds, sampling: Sampling, stop: Sequence[str],
        tokenizer: RouterTokenizer, arrival: float,
    ) -> None:  # fmt: skip
        self.request_id = request_id
        self.detokenizer = tokenizer.detokenizer(prompt_ids)
        self.matcher = StopStringMatcher(stop)
        self.min_tokens = sampling.min_tokens
        self.logprobs = sampling.logprobs
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0
        self.num_generated = 0
        self.arrival = arrival
        self.worker_timings = Timings()
        self.decode_first_seen = 0.0
        self.finish_reason: pb.FinishReason = pb.FINISH_REASON_UNSPECIFIED
        self.worker_finished = False
        """The worker ended the request itself (no AbortCmd needed)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason != pb.FINISH_REASON_UNSPECIFIED

    def build(self, event: TokenEvent, now: float) -> pb.GenerateResponse:
        """The response for one in-order event; `now` is when the router received it (epoch seconds)."""
        self._record(event, now)
        token_ids, text = self._tokens_and_text(event.token_ids)
        if not self.finished and event.finish_reason is not None:
            self.worker_finished = True
            text.append(self._visible(self.detokenizer.flush()))
            text.append(self.matcher.flush())
            reason = FINISH_REASONS.get(event.finish_reason, pb.FINISH_REASON_ABORT)
            self.finish_reason = pb.FINISH_REASON_STOP if self.matcher.stopped else reason
        response = pb.GenerateResponse(token_ids=token_ids, text="".join(text), request_id=self.request_id)
        if self.logprobs:
            response.logprobs.extend(_logprobs_pb(event, len(token_ids)))
        if self.finished:
            response.finish_reason = self.finish_reason
            response.usage.CopyFrom(self.usage())
            response.timings.CopyFrom(self.timings())
        return response

    def _tokens_and_text(self, new_ids: Sequence[int]) -> tuple[list[int], list[str]]:
        """The tokens this response carries and their text pieces; stops at a stop string."""
        if not self.matcher.stops:  # NOTE: the common case: one detokenizer pass for all of them
            self.num_generated += len(new_ids)
            return list(new_ids), [self.detokenizer.extend(new_ids)]
        token_ids: list[int] = []
        text: list[str] = []
        for token_id in new_ids:
            token_ids.append(token_id)
            self.num_generated += 1
            text.append(self._visible(self.detokenizer.step(token_id)))
            if self.matcher.stopped:
                self.finish_reason = pb.FINISH_REASON_STOP
                break
        return token_ids, text

    def _visible(self, delta: str) -> str:
        # NOTE: like stop token ids, stop strings only count once min_tokens tokens exist.
        return delta if self.num_generated <= self.min_tokens else self.matcher.feed(delta)

    def _record(self, event: TokenEvent, now: float) -> None:
        if event.timings is not None:
            self.worker_timings = event.timings
        if event.index == 0 or event.num_cached_tokens:
            self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        if event.index > 0 and not self.decode_first_seen:
            self.decode_first_seen = now

    def usage(self) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_generated,
            cached_prompt_tokens=self.num_cached_tokens,
        )

    def timings(self) -> pb.Timings:
        """From the workers' clocks; handoff ends when the decode worker says so, or else (the workers do not
        report it) when its first token reached the router."""
        t = self.worker_timings
        arrival = t.arrival or self.arrival
        handoff_end = t.handoff_end or self.decode_first_seen
        return pb.Timings(
            queue_ms=_ms(arrival, t.prefill_start),
            prefill_ms=_ms(t.prefill_start, t.prefill_end),
            handoff_ms=_ms(t.prefill_end, handoff_end),
            first_token_ms=_ms(arrival, t.first_token),
        )


def _logprobs_pb(event: TokenEvent, num_tokens: int) -> list[pb.Logprobs]:
    """The logprobs of the event's first num_tokens tokens (those the response carries: a stop string may cut
    the rest)."""
    entries = _logprobs_of(event)[:num_tokens]
    return [
        pb.Logprobs(logprob=lp, top=[pb.TokenLogprob(token_id=i, logprob=v) for i, v in zip(ids, top, strict=True)])
        for lp, ids, top in entries
    ]


def _ms(start: float, end: float) -> float:
    return max(0.0, (end - start) * 1000.0) if start and end else 0.0
