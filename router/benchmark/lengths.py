"""Prompt and output length distributions of published workloads, as seeded samplers (numpy only: the planner,
router/plan/, draws from the same ones).

Each synthetic workload is a pair of truncated log-normal distributions whose means are the published ones; the
log-normal shape and its sigma are our fit of the published histograms' long right tails, not published figures.
A JSONL of real lengths ({"input_len": N, "output_len": M} per line) is sampled with replacement instead.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclass(frozen=True)
class LogNormalLengths:
    """Integer lengths exp(N(mu, sigma^2)) kept within [lo, hi], mu chosen so that the kept mean is `mean`."""

    mean: float
    """Mean length after truncation (the published figure)."""
    sigma: float
    """Standard deviation of log(length)."""
    lo: int
    """Shortest length kept."""
    hi: int
    """Longest length kept."""

    def truncated_mean(self, mu: float) -> float:
        """E[X | lo <= X <= hi] for X = exp(N(mu, sigma^2))."""
        s, a, b = self.sigma, math.log(self.lo), math.log(self.hi)
        kept = _phi((b - mu) / s) - _phi((a - mu) / s)
        if kept <= 0.0:
            return self.lo if mu < a else self.hi
        shifted = _phi((b - mu - s * s) / s) - _phi((a - mu - s * s) / s)
        return math.exp(mu + s * s / 2) * shifted / kept

    @property
    def mu(self) -> float:
        """The log-mean whose truncated mean is `mean` (bisection; the truncated mean grows with mu)."""
        if not self.lo < self.mean < self.hi:
            raise ValueError(f"mean {self.mean} not inside [{self.lo}, {self.hi}]")
        lo, hi = math.log(self.lo) - 4 * self.sigma, math.log(self.hi) + 4 * self.sigma
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.truncated_mean(mid) < self.mean else (lo, mid)
        return (lo + hi) / 2

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n] int64 lengths (rejection sampling of the truncated log-normal)."""
        mu, out = self.mu, np.empty(0, dtype=np.int64)
        while out.size < n:
            draws = np.rint(np.exp(rng.normal(mu, self.sigma, size=2 * (n - out.size) + 16))).astype(np.int64)
            out = np.concatenate([out, draws[(draws >= self.lo) & (draws <= self.hi)]])
        return out[:n]


class LengthSampler(Protocol):
    """Draws (input_len, output_len) pairs."""

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> str: ...

    @property
    def mean_input_len(self) -> float: ...

    @property
    def mean_output_len(self) -> float: ...

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """[n] input lengths and [n] output lengths (int64)."""
        ...


@dataclass(frozen=True)
class SyntheticWorkload:
    """A named workload: independent input and output length distributions and where they come from."""

    name: str
    input_len: LogNormalLengths
    output_len: LogNormalLengths
    source: str
    """The published figures the means come from."""

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self.input_len.sample(rng, n), self.output_len.sample(rng, n)

    @property
    def mean_input_len(self) -> float:
        return self.input_len.mean

    @property
    def mean_output_len(self) -> float:
        return self.output_len.mean


@dataclass(frozen=True)
class JsonlWorkload:
    """Real (input_len, output_len) pairs, drawn uniformly with replacement."""

    name: str
    input_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    source: str

    @classmethod
    def read(cls, path: str | Path) -> JsonlWorkload:
        """One JSON object per line with integer input_len and output_len (>= 1); blank lines skipped."""
        pairs = []
        for k, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            pair = (int(row["input_len"]), int(row["output_len"]))
            if min(pair) < 1:
                raise ValueError(f"{path}:{k}: input_len and output_len must be >= 1")
            pairs.append(pair)
        if not pairs:
            raise ValueError(f"{path}: no lengths")
        ins, outs = zip(*pairs, strict=True)
        return cls("jsonl", ins, outs, f"{path} ({len(pairs)} requests)")

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        pick = rng.integers(0, len(self.input_lens), size=n)
        return np.asarray(self.input_lens)[pick], np.asarray(self.output_lens)[pick]

    @property
    def mean_input_len(self) -> float:
        return float(np.mean(self.input_lens))

    @property
    def mean_output_len(self) -> float:
        return float(np.mean(self.output_lens))


@dataclass(frozen=True)
class UniformWorkload:
    """Lengths uniform in inclusive ranges (`--dataset random` in a sweep)."""

    input_range: tuple[int, int]
    output_range: tuple[int, int]
    name: str = "random"
    source: str = "uniform in the --input-len / --output-len ranges"

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        (a, b), (c, d) = self.input_range, self.output_range
        return rng.integers(a, b + 1, size=n), rng.integers(c, d + 1, size=n)

    @property
    def mean_input_len(self) -> float:
        return sum(self.input_range) / 2

    @property
    def mean_output_len(self) -> float:
        return sum(self.output_range) / 2


CHAT = SyntheticWorkload(
    "chat",
    LogNormalLengths(mean=220, sigma=1.0, lo=4, hi=1024),
    LogNormalLengths(mean=200, sigma=1.0, lo=4, hi=1024),
    "ShareGPT_V3_unfiltered_cleaned_split as vLLM's benchmark_serving samples it (prompts and outputs of 4-1024 "
    "tokens, Llama tokenizer): about 220 prompt and 200 output tokens per request",
)
LONG_INPUT = SyntheticWorkload(
    "long-input",
    LogNormalLengths(mean=4000, sigma=0.6, lo=1024, hi=7680),
    LogNormalLengths(mean=200, sigma=0.5, lo=32, hi=512),
    "LongBench summarization (Bai et al. 2023, arXiv:2308.14508: GovReport, QMSum, MultiNews, VCSUM; average "
    "inputs of 2k-15k words, outputs capped at 512 tokens), prompts truncated to an 8k context as LongBench "
    "truncates them to the model's window: 4000 prompt / 200 output tokens on average",
)
LONG_CONTEXT = SyntheticWorkload(
    "long-context",
    LogNormalLengths(mean=12035, sigma=0.8, lo=256, hi=131072),
    LogNormalLengths(mean=343, sigma=0.8, lo=1, hi=4096),
    "Mooncake's conversation trace (Qin et al., FAST'25, arXiv:2407.00079; kvcache-ai/Mooncake "
    "traces/conversation_trace.jsonl): 12035 prompt / 343 output tokens on average",
)
WORKLOADS: dict[str, SyntheticWorkload] = {w.name: w for w in (CHAT, LONG_INPUT, LONG_CONTEXT)}
"""The synthetic workloads by name (`--dataset NAME`, `pdserve-plan --workload NAME`)."""


def workload_named(name: str, path: str | None = None) -> SyntheticWorkload | JsonlWorkload:
    """WORKLOADS[name], or the JSONL at path for name "jsonl"; ValueError otherwise."""
    if name == "jsonl":
        if not path:
            raise ValueError("the jsonl workload needs a path (--dataset-path)")
        return JsonlWorkload.read(path)
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: one of {sorted(WORKLOADS)} or jsonl")
    return WORKLOADS[name]


def fit_to_context(inputs: np.ndarray, outputs: np.ndarray, max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut prompts so that prompt + output fits max_model_len (outputs first cut to half of it); lengths >= 1."""
    outputs = np.clip(outputs, 1, max(1, max_model_len // 2))
    inputs = np.clip(np.minimum(inputs, max_model_len - outputs), 1, None)
    return inputs, outputs
