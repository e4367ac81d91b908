"""Benchmark workloads: lists of request specs, deterministic from a seed.

Open-loop requests carry a scheduled start time (seconds after the benchmark starts); the long-prompt
workload adds a closed loop of short streams, each replaced by the next one when it ends.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from pdserve.router.benchmark.lengths import LengthSampler, fit_to_context
from pdserve.router.tokenizer import RouterTokenizer

SendAs = Literal["ids", "text"]
_WORD_MARKERS = ("Ġ", "▁")  # NOTE: byte-level BPE (GPT-2) and sentencepiece mark a leading space this way.


@dataclass(frozen=True)
class VocabInfo:
    """Which token ids a random prompt may use."""

    vocab_size: int
    """Valid ids are [0, vocab_size)."""
    eos_token_ids: tuple[int, ...] = ()
    """Never put in a prompt."""

    def allowed_ids(self) -> np.ndarray:
        """[vocab_size - eos ids] int64, read-only; made once per vocabulary.

        NOTE: the closed loop draws a prompt for every request it sends, inside the client's event loop: a
        setdiff1d over a 128k vocabulary per request (sorting it) stalled every stream of that client process
        for milliseconds, and those stalls made the ITL tail the benchmark reported (p99 ~50 ms at 64 streams).
        """
        return _allowed_ids(self.vocab_size, self.eos_token_ids)


@functools.cache
def _allowed_ids(vocab_size: int, eos_token_ids: tuple[int, ...]) -> np.ndarray:
    ids = np.setdiff1d(np.arange(vocab_size), np.asarray(eos_token_ids, dtype=np.int64))
    ids.flags.writeable = False
    return ids


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload."""

    prompt_ids: tuple[int, ...]
    """The prompt's token ids (also when sent as text: what the tokenizer makes of it)."""
    output_len: int
    """max_tokens; with ignore_eos, the exact output length."""
    tag: str = "default"
    """Metrics are reported per tag as well as overall."""
    text: str | None = None
    """The prompt as text, for send_as == "text"."""
    send_as: SendAs = "ids"
    """Which input field of GenerateRequest carries the prompt."""
    start_time: float | None = None
    """Seconds after the benchmark starts; None = unscheduled (closed loop)."""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class ClosedLoop:
    """num_streams concurrent streams for duration_s seconds; spec(k) is the k-th request sent."""

    num_streams: int
    """Requests in flight at any time."""
    duration_s: float
    """No new request starts after this many seconds."""
    input_len: int
    """Prompt tokens of each request."""
    output_len: int
    """Output tokens of each request."""
    vocab: VocabInfo
    """Where the prompt ids come from."""
    seed: int
    """spec(k) depends only on (seed, k)."""
    tag: str = "short"
    """Tag of every request of the loop."""

    def spec(self, k: int) -> RequestSpec:
        rng = np.random.default_rng([self.seed, 7, k])
        ids = random_ids(rng, self.vocab, self.input_len)
        return RequestSpec(ids, self.output_len, self.tag)


@dataclass(frozen=True)
class Workload:
    """Open-loop requests (each with a start time) plus an optional closed loop."""

    requests: tuple[RequestSpec, ...]
    """Sent at their start_time."""
    closed_loop: ClosedLoop | None = None
    """Runs from t=0 beside the open-loop requests."""


def parse_range(text: str) -> tuple[int, int]:
    """Parse "MIN:MAX" or "N" into (MIN, MAX), both inclusive."""
    lo, _, hi = text.partition(":")
    bounds = (int(lo), int(hi or lo))
    if not 0 <= bounds[0] <= bounds[1]:
        raise ValueError(f"bad range {text!r}: want MIN:MAX with 0 <= MIN <= MAX")
    return bounds


def random_ids(rng: np.random.Generator, vocab: VocabInfo, n: int) -> tuple[int, ...]:
    """n ids uniform over the vocabulary without the eos ids."""
    allowed = vocab.allowed_ids()
    return tuple(int(i) for i in allowed[rng.integers(0, len(allowed), size=n)])


def _lengths(rng: np.random.Generator, bounds: tuple[int, int], n: int) -> list[int]:
    return [int(x) for x in rng.integers(bounds[0], bounds[1] + 1, size=n)]


def random_dataset(
    vocab: VocabInfo, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> list[RequestSpec]:
    """Prompt and output lengths uniform in their ranges, ids uniform."""
    rng = np.random.default_rng(seed)
    inputs, outputs = _lengths(rng, input_len, num_prompts), _lengths(rng, output_len, num_prompts)
    return [RequestSpec(random_ids(rng, vocab, i), o, "random") for i, o in zip(inputs, outputs, strict=True)]


def shared_prefix_dataset(
    vocab: VocabInfo,
    num_prompts: int,
    num_groups: int,
    prefix_len: int,
    suffix_len: int,
    output_len: tuple[int, int],
    seed: int,
) -> list[RequestSpec]:
    """Request k belongs to group k % num_groups: the group's prefix plus its own suffix; then shuffled."""
    rng = np.random.default_rng(seed)
    prefixes = [random_ids(rng, vocab, prefix_len) for _ in range(num_groups)]
    outputs = _lengths(rng, output_len, num_prompts)
    specs = [
        RequestSpec(prefixes[k % num_groups] + random_ids(rng, vocab, suffix_len), outputs[k], "shared-prefix")
        for k in range(num_prompts)
    ]
    order = rng.permutation(num_prompts)
    return [specs[int(i)] for i in order]


def poisson_times(rng: np.random.Generator, rate: float, duration_s: float) -> list[float]:
    """Arrival times of a Poisson process of `rate` per second in [0, duration_s)."""
    times: list[float] = []
    t = float(rng.exponential(1.0 / rate)) if rate > 0 else math.inf
    while t < duration_s:
        times.append(t)
        t += float(rng.exponential(1.0 / rate))
    return times


def long_prompt_workload(
    vocab: VocabInfo,
    num_short: int,
    short_io: tuple[int, int],
    long_io: tuple[int, int],
    long_rate: float,
    duration_s: float,
    seed: int,
) -> Workload:
    """Closed loop of num_short short streams plus Poisson long prompts; *_io = (input_len, output_len)."""
    rng = np.random.default_rng(seed)
    times = poisson_times(rng, long_rate, duration_s)
    longs = tuple(RequestSpec(random_ids(rng, vocab, long_io[0]), long_io[1], "long", start_time=t) for t in times)
    loop = ClosedLoop(num_short, duration_s, short_io[0], short_io[1], vocab, seed)
    return Workload(longs, loop if num_short > 0 else None)


def vocabulary_words(tokenizer: RouterTokenizer, vocab_size: int) -> list[str]:
    """Whole alphabetic words of the tokenizer's vocabulary (tokens with a leading-space marker), by id."""
    vocab = tokenizer.tokenizer.get_vocab()
    words = {i: t[1:] for t, i in vocab.items() if i < vocab_size and t[:1] in _WORD_MARKERS and t[1:].isalpha()}
    return [words[i] for i in sorted(words) if words[i].isascii()]


def duplicate_dataset(
    tokenizer: RouterTokenizer,
    vocab_size: int,
    num_groups: int,
    copies: int,
    num_words: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> list[RequestSpec]:
    """num_groups random texts, each sent `copies` times in a row, alternately as text and as its token ids.

    Tagged by how they are sent ("text" / "ids"); both carry the same prompt_ids (the tokenizer's encode(text)).
    """
    rng = np.random.default_rng(seed)
    words = vocabulary_words(tokenizer, vocab_size)
    if not words:
        raise ValueError("the tokenizer has no whole-word tokens to build text from")
    specs = []
    for n in _lengths(rng, num_words, num_groups):
        text = " ".join(words[int(i)] for i in rng.integers(0, len(words), size=n))
        ids, out = tuple(tokenizer.encode(text)), _lengths(rng, output_len, 1)[0]
        for c in range(copies):
            send_as: SendAs = "text" if c % 2 == 0 else "ids"
            specs.append(RequestSpec(ids, out, send_as, text=text, send_as=send_as))
    return specs


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Start times of n requests: gamma inter-arrival times (shape=burstiness, mean 1/rate), first at 0.

    burstiness 1.0 is a Poisson process; rate inf sends everything at t=0 (as vLLM's benchmark_serving).
    """
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = np.random.default_rng([seed, 1])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def schedule(specs: Sequence[RequestSpec], rate: float, burstiness: float, seed: int) -> Workload:
    """An open-loop workload: the specs with start times from arrival_offsets."""
    offsets = arrival_offsets(len(specs), rate, burstiness, seed)
    return Workload(tuple(replace(s, start_time=float(t)) for s, t in zip(specs, offsets, strict=True)))


def sampled_workload(
    vocab: VocabInfo, sampler: LengthSampler, rate: float, duration_s: float, max_model_len: int, seed: int
) -> Workload:
    """Poisson arrivals of `rate` per second over [0, duration_s), each with lengths from the sampler (cut to
    fit max_model_len) and uniform random prompt ids; tagged with the sampler's name."""
    rng = np.random.default_rng([seed, 3])
    times = poisson_times(rng, rate, duration_s)
    inputs, outputs = fit_to_context(*sampler.sample(rng, len(times)), max_model_len)
    tag = getattr(sampler, "name", "sampled")
    specs = (
        RequestSpec(random_ids(rng, vocab, int(i)), int(o), tag, start_time=t)
        for t, i, o in zip(times, inputs, outputs, strict=True)
    )
    return Workload(tuple(specs))
