"""Predicted goodput of a layout: the highest Poisson rate at which the simulation (simulate.py) has `target` of
its requests meeting every SLO, found by a geometric bisection between a rate that passes and one that fails.

Every rate and layout replays the same requests (one seeded draw of lengths and of unit-rate arrival gaps, scaled
by 1/rate), so comparisons are not blurred by sampling noise. The first and last `edge` share of the requests is
left out: the first see an empty system, the last one that drains.
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


@dataclass(frozen=True)
class PlanConfig:
    """How hard the planner looks."""

    num_requests: int = 400
    """Requests per simulated rate."""
    edge: float = 0.1
    """Share of the first and of the last requests left out of the attainment."""
    target: float = 0.9
    """Attainment the goodput rate must reach (DistServe's 90%)."""
    steps: int = 10
    """Bisection steps between a passing and a failing rate."""
    seed: int = 0
    """Seed of the lengths and arrival gaps."""
    sim: SimConfig = field(default_factory=SimConfig)
    """Batching limits of the simulated workers."""


@dataclass(frozen=True)
class Trace:
    """One draw of requests: lengths and the arrival times of a rate-1 Poisson process."""

    unit_arrivals: np.ndarray
    prompt_lens: np.ndarray
    output_lens: np.ndarray

    @classmethod
    def draw(cls, sampler: LengthSampler, num_requests: int, seed: int, max_model_len: int | None) -> Trace:
        rng = np.random.default_rng([seed, 37])
        prompts, outputs = sampler.sample(rng, num_requests)
        if max_model_len is not None:
            prompts = np.minimum(prompts, np.maximum(max_model_len - outputs, 1))
        return cls(np.cumsum(rng.exponential(1.0, num_requests)), prompts, outputs)

    def requests(self, rate: float) -> list[SimRequest]:
        return make_requests(self.unit_arrivals / rate, self.prompt_lens, self.output_lens)


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
    """Simulate the layout at `rate` and score the measured requests against the SLOs (ms)."""
    done = simulate(layout, cost, trace.requests(rate), plan.sim)
    cut = int(len(done) * plan.edge)
    measured = done[cut : len(done) - cut] or done
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
    mean_in, mean_out = float(trace.prompt_lens.mean()), float(trace.output_lens.mean())
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
