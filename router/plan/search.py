"""Predicted goodput of a layout: the highest Poisson rate at which the simulation (simulate.py) has `target` of
its requests meeting every SLO, found by a geometric bisection between a rate that passes and one that fails.

A rate is judged as pdserve-bench-serving measures it: arrivals for `warmup_s`, then a window of `duration_s` whose
arrivals are scored, then none (the system drains). The count of requests grows with the rate, so a rate the
layout cannot sustain builds a queue over the window and fails; a fixed count of requests would arrive as one
burst at high rates and finish within a loose TTFT even where the layout could not keep up.

Every rate and layout replays one seeded stream of requests (lengths and unit-rate arrival gaps, arrivals scaled
by 1/rate; a lower rate's requests are a prefix of a higher one's), so comparisons are not blurred by sampling noise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pdserve.router.benchmark.lengths import LengthSampler
from pdserve.router.plan.layouts import Layout, WorkerSlot
from pdserve.router.plan.simulate import SimConfig, SimRequest, StepCost, make_requests, simulate

SLO_KINDS = ("ttft", "tpot", "itl_p99", "e2el")
DRAW_BLOCK = 4096
"""Requests the stream draws at a time."""


@dataclass(frozen=True)
class PlanConfig:
    """How hard the planner looks."""

    warmup_s: float = 10.0
    """Seconds of arrivals before the scored window (bench_goodput's --warmup)."""
    duration_s: float = 20.0
    """The scored window: requests arriving in it count (bench_goodput's --duration)."""
    min_requests: int = 100
    """At a rate too low for this many arrivals in duration_s, the window is longer."""
    target: float = 0.9
    """Attainment the goodput rate must reach (DistServe's 90%)."""
    steps: int = 10
    """Bisection steps between a passing and a failing rate."""
    seed: int = 0
    """Seed of the lengths and arrival gaps."""
    sim: SimConfig = field(default_factory=SimConfig)
    """Batching limits of the simulated workers."""


class Trace:
    """One seeded stream of requests: lengths and the arrival times of a rate-1 Poisson process, drawn in blocks of
    DRAW_BLOCK as far as a rate's span needs (each block from its own seeded generator: the same stream however
    far it is drawn)."""

    def __init__(self, sampler: LengthSampler, seed: int, max_model_len: int | None) -> None:
        self.sampler, self.seed, self.max_model_len = sampler, seed, max_model_len
        self.unit_arrivals = np.zeros(0)
        self.prompt_lens = np.zeros(0, dtype=np.int64)
        self.output_lens = np.zeros(0, dtype=np.int64)
        self._draw()

    def _draw(self) -> None:
        rng = np.random.default_rng([self.seed, 37, self.unit_arrivals.size // DRAW_BLOCK])
        prompts, outputs = self.sampler.sample(rng, DRAW_BLOCK)
        if self.max_model_len is not None:
            prompts = np.minimum(prompts, np.maximum(self.max_model_len - outputs, 1))
        start = self.unit_arrivals[-1] if self.unit_arrivals.size else 0.0
        self.unit_arrivals = np.concatenate([self.unit_arrivals, start + np.cumsum(rng.exponential(1.0, DRAW_BLOCK))])
        self.prompt_lens = np.concatenate([self.prompt_lens, prompts])
        self.output_lens = np.concatenate([self.output_lens, outputs])

    @property
    def mean_input_len(self) -> float:
        return float(self.prompt_lens[:DRAW_BLOCK].mean())

    @property
    def mean_output_len(self) -> float:
        return float(self.output_lens[:DRAW_BLOCK].mean())

    def window(self, rate: float, plan: PlanConfig) -> tuple[list[SimRequest], slice]:
        """The requests arriving before the window's end at `rate`, and the slice of them arriving in it."""
        window_s = max(plan.duration_s, plan.min_requests / rate)
        first, end = plan.warmup_s * rate, (plan.warmup_s + window_s) * rate
        while self.unit_arrivals[-1] < end:
            self._draw()
        n = int(np.searchsorted(self.unit_arrivals, end))
        k = int(np.searchsorted(self.unit_arrivals, first))
        requests = make_requests(self.unit_arrivals[:n] / rate, self.prompt_lens[:n], self.output_lens[:n])
        return requests, slice(k, n)


class Outcome(NamedTuple):
    """The simulation at one rate."""

    rate: float
    attainment: float
    """Share of measured requests meeting every SLO."""
    by_kind: dict[str, float]
    """Share meeting each SLO alone."""
    p90_ttft_ms: float
    p90_tpot_ms: float


def slo_value(req: SimRequest, kind: str) -> float:
    """The figure (s) an SLO of kind bounds."""
    if kind == "ttft":
        return req.ttft
    if kind == "tpot":
        return req.tpot
    if kind == "e2el":
        return req.done - req.arrival
    return req.itl_p99()


def evaluate(
    layout: Layout, cost: StepCost, trace: Trace, rate: float, slos: Mapping[str, float], plan: PlanConfig
) -> Outcome:
    """Simulate the layout at `rate` and score the requests arriving in the window against the SLOs (ms)."""
    requests, scored = trace.window(rate, plan)
    measured = simulate(layout, cost, requests, plan.sim)[scored]
    meets = {k: np.array([slo_value(r, k) * 1e3 <= v for r in measured]) for k, v in slos.items()}
    every = np.logical_and.reduce(list(meets.values())) if meets else np.ones(len(measured), dtype=bool)
    return Outcome(
        rate, float(every.mean()), {k: float(m.mean()) for k, m in meets.items()},
        float(np.percentile([r.ttft for r in measured], 90) * 1e3),
        float(np.percentile([r.tpot for r in measured], 90) * 1e3),
    )  # fmt: skip


class LayoutResult(NamedTuple):
    """A layout's predicted goodput and what limits it."""

    layout: Layout
    goodput: float
    """req/s of the whole layout at the target attainment (0: not even at a trickle)."""
    at_knee: Outcome | None
    """The highest passing rate's simulation."""
    over: Outcome | None
    """The lowest failing rate's simulation: which SLO breaks first."""

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.layout.num_gpus

    @property
    def breaks_first(self) -> str | None:
        """The SLO kind the fewest requests meet just past the knee."""
        if self.over is None or not self.over.by_kind:
            return None
        return min(self.over.by_kind, key=lambda k: self.over.by_kind[k] if self.over else 0.0)


def capacity_guess(layout: Layout, cost: StepCost, trace: Trace, plan: PlanConfig) -> float:
    """An upper bound of the layout's rate (req/s): the lesser of its prefill and decode ceilings (each worker's at
    its TP size, times its SM share)."""
    mean_in, mean_out = trace.mean_input_len, trace.mean_output_len
    context = mean_in + mean_out / 2

    def rate(w: WorkerSlot, role: str) -> float:
        profile = cost.at_tp(w.tp_size).profile
        if role == "prefill":
            return w.sm_share * profile.prefill_tokens_per_s() / mean_in
        return w.sm_share * profile.decode_tokens_per_s(plan.sim.max_num_seqs, context) / mean_out

    prefill = sum(rate(w, "prefill") for w in layout.prefill or layout.decode)
    return min(prefill, sum(rate(w, "decode") for w in layout.decode))


def find_goodput(
    layout: Layout, cost: StepCost, trace: Trace, slos: Mapping[str, float], plan: PlanConfig
) -> LayoutResult:
    """Bisect (geometrically) for the highest rate whose attainment reaches plan.target."""
    hi = 2.0 * capacity_guess(layout, cost, trace, plan)
    lo = hi / 256
    passing = evaluate(layout, cost, trace, lo, slos, plan)
    if passing.attainment < plan.target:
        return LayoutResult(layout, 0.0, None, passing)
    failing = evaluate(layout, cost, trace, hi, slos, plan)
    for _ in range(4):
        if failing.attainment < plan.target:
            break
        passing, failing = failing, evaluate(layout, cost, trace, failing.rate * 2, slos, plan)
    for _ in range(plan.steps):
        mid = evaluate(layout, cost, trace, float(np.sqrt(passing.rate * failing.rate)), slos, plan)
        passing, failing = (mid, failing) if mid.attainment >= plan.target else (passing, mid)
    return LayoutResult(layout, passing.rate, passing, failing)
