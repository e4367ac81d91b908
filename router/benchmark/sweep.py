"""Goodput sweeps (DistServe's goodput: the highest request rate at which a target share of requests, 90% by
default, meet every SLO): per-rate figures from the records of a measured window, the knee of a sweep, and the
bisection that finds it. Pure functions of records; sweep_run.py sends the load.

Each rate runs for warm-up + duration seconds of Poisson arrivals; only requests *sent* inside the window
[warmup, warmup + duration) count, and every figure divides by the window's length, so a system that falls behind
cannot finish early: its late requests miss their SLOs (or fail at the drain deadline) and count as not good.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from pdserve.router.benchmark.metrics import RequestRecord, compute_metrics, meets_slos

DEFAULT_TARGET = 0.9
"""Share of requests that must meet every SLO (DistServe's 90%)."""


@dataclass(frozen=True)
class Window:
    """The measured part of a rate's run, in seconds since its start."""

    warmup_s: float
    """Requests sent before this are left out."""
    duration_s: float
    """Length of the window; the divisor of every rate figure."""

    @property
    def end_s(self) -> float:
        return self.warmup_s + self.duration_s

    def select(self, records: Sequence[RequestRecord]) -> list[RequestRecord]:
        """The records sent inside the window."""
        return [r for r in records if self.warmup_s <= r.send_time < self.end_s]


@dataclass(frozen=True)
class RateSearch:
    """`--rate-search lo,hi,steps`: measure lo and hi, then bisect between the last passing and first failing."""

    lo: float
    hi: float
    steps: int

    @classmethod
    def parse(cls, text: str) -> RateSearch:
        try:
            lo, hi, steps = text.split(",")
            search = cls(float(lo), float(hi), int(steps))
        except ValueError:
            raise ValueError(f"bad rate search {text!r}: want LO,HI,STEPS, e.g. 1,16,4") from None
        if not 0 < search.lo < search.hi or search.steps < 0:
            raise ValueError(f"bad rate search {text!r}: want 0 < LO < HI and STEPS >= 0")
        return search


def parse_rates(text: str) -> list[float]:
    """Parse "2,4,8" into [2.0, 4.0, 8.0] ("inf": [inf])."""
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"bad request rates {text!r}: want positive numbers, comma-separated")
    return rates


def attainment_by_kind(records: Sequence[RequestRecord], slos: Mapping[str, float]) -> dict[str, float]:
    """Per SLO kind, the share of records that meet it alone (a failed request meets none)."""
    n = max(len(records), 1)
    return {k: sum(r.ok and meets_slos(r, {k: v}) for r in records) / n for k, v in slos.items()}


def rate_result(
    rate: float,
    records: Sequence[RequestRecord],
    window: Window,
    slos: Mapping[str, float],
    num_gpus: int,
    percentiles: Sequence[float] = (50, 90, 99),
) -> dict[str, Any]:
    """One rate's figures: vLLM's metrics over the window's requests (throughputs per window second), the SLO
    attainment (good / sent; failed requests are not good), goodput and the per-GPU rates."""
    sent = window.select(records)
    good = sum(r.ok and meets_slos(r, slos) for r in sent)
    metrics = compute_metrics(sent, percentiles, slos or None, window.duration_s)
    goodput = good / window.duration_s
    return {
        "request_rate": rate,
        "num_requests": len(sent),
        "num_good": good,
        "slo_attainment": good / len(sent) if sent else 0.0,
        "slo_attainment_by_kind": attainment_by_kind(sent, slos),
        "goodput": goodput,
        "goodput_per_gpu": goodput / num_gpus,
        "request_throughput_per_gpu": metrics["request_throughput"] / num_gpus,
        "metrics": metrics,
    }


class Knee(NamedTuple):
    """The goodput knee of a sweep."""

    rate: float | None
    """Highest measured rate whose attainment reaches the target; None when none does."""
    interpolated: float | None
    """Where attainment crosses the target between that rate and the next one measured (linear); the rate
    itself when no higher rate was measured."""
    goodput_per_gpu: float | None
    """That rate's goodput per GPU."""


def find_knee(results: Sequence[Mapping[str, Any]], target: float = DEFAULT_TARGET) -> Knee:
    """The knee of rate_result dicts (any order)."""
    ordered = sorted(results, key=lambda r: r["request_rate"])
    passing = [k for k, r in enumerate(ordered) if r["slo_attainment"] >= target]
    if not passing:
        return Knee(None, None, None)
    k = passing[-1]
    best = ordered[k]
    rate, interpolated = best["request_rate"], best["request_rate"]
    if k + 1 < len(ordered):
        nxt = ordered[k + 1]
        a1, a2 = best["slo_attainment"], nxt["slo_attainment"]
        interpolated = rate + (a1 - target) / (a1 - a2) * (nxt["request_rate"] - rate)
    return Knee(rate, interpolated, best["goodput_per_gpu"])


def search_rates(measure: Callable[[float], float], search: RateSearch, target: float = DEFAULT_TARGET) -> None:
    """Call measure(rate) -> attainment at lo and hi, then `steps` times at the midpoint of the highest passing
    and lowest failing rate; stops early when lo fails or hi passes (the knee is outside [lo, hi])."""
    lo, hi = search.lo, search.hi
    if measure(lo) < target or measure(hi) >= target:
        return
    for _ in range(search.steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if measure(mid) >= target else (lo, mid)


def summary(
    results: Sequence[Mapping[str, Any]], slos: Mapping[str, float], num_gpus: int, layout: str, target: float
) -> dict[str, Any]:
    """The sweep's summary: one compact row per rate, and the knee."""
    keys = ("request_rate", "num_requests", "slo_attainment", "goodput", "goodput_per_gpu")
    rows = [{k: r[k] for k in keys} | {"slo_attainment_by_kind": r["slo_attainment_by_kind"]} for r in results]
    for row, r in zip(rows, results, strict=True):
        m = r["metrics"]
        row |= {k: m[k] for k in ("request_throughput", "output_throughput", "p90_ttft_ms", "p90_tpot_ms")}
    knee = find_knee(results, target)
    return {
        "layout": layout,
        "num_gpus": num_gpus,
        "slos_ms": dict(slos),
        "target_attainment": target,
        "rates": sorted(rows, key=lambda r: r["request_rate"]),
        "knee": knee._asdict(),
    }


def format_summary(summ: Mapping[str, Any]) -> str:
    """A table of the sweep: rate, attainment, goodput per GPU, p90 TTFT / TPOT; then the knee."""
    lines = [f"{' Goodput sweep ' + (summ['layout'] or '') + ' ':=^78}"]
    lines.append(f"{'rate':>8} {'sent':>6} {'attain':>7} {'goodput':>8} {'/GPU':>7} {'p90 TTFT':>9} {'p90 TPOT':>9}")
    for r in summ["rates"]:
        lines.append(
            f"{r['request_rate']:8.3g} {r['num_requests']:6d} {r['slo_attainment']:7.1%} {r['goodput']:8.3f} "
            f"{r['goodput_per_gpu']:7.3f} {r['p90_ttft_ms']:9.1f} {r['p90_tpot_ms']:9.2f}"
        )
    knee = summ["knee"]
    target = f"{summ['target_attainment']:.0%}"
    if knee["rate"] is None:
        lines.append(f"knee: no rate reached {target} attainment")
    else:
        lines.append(
            f"knee ({target} attainment): {knee['rate']:g} req/s measured, ~{knee['interpolated']:.3g} interpolated; "
            f"goodput {knee['goodput_per_gpu']:.3f} req/s per GPU"
        )
    return "\n".join(lines)
