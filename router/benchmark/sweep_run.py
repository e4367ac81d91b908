"""Run a goodput sweep against one running router: an open-loop run of warm-up + duration seconds per rate
(the listed rates, then an optional bisection), each written as it finishes; then the summary and the knee.

    pdserve-bench-serving --dataset long-input --request-rate 0.5,1,2,4 --duration 120 --warmup 20 \\
        --goodput ttft:1000 tpot:15 --num-gpus 2 --layout 1P:1D --result-json bench/out/long-input-1p1d.json
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.router.benchmark.datasets import Workload
from pdserve.router.benchmark.metrics import RequestRecord, metrics_by_tag, record_json
from pdserve.router.benchmark.run_config import RunConfig
from pdserve.router.benchmark.runner import run_in_processes
from pdserve.router.benchmark.sweep import (
    RateSearch,
    Window,
    format_summary,
    rate_result,
    search_rates,
    summary,
)

COOLDOWN_S = 2.0
"""Pause between two rates: requests cut off at the drain deadline leave the cluster."""

WorkloadAt = Callable[[float], Workload]
"""The open-loop workload of one rate (req/s), spanning the warm-up and the window."""


@dataclass(frozen=True)
class SweepConfig:
    """What a sweep measures and how it reports."""

    rates: tuple[float, ...]
    """Rates measured in order (req/s)."""
    search: RateSearch | None
    """Bisection after the listed rates; None: none."""
    window: Window
    """Warm-up and measured window of each rate."""
    drain_s: float
    """Seconds after the window that requests may still run before they are cut off (and count as failed)."""
    slos: Mapping[str, float]
    """SLOs in ms by kind (metrics.SLO_KINDS); a request is good when it meets all of them."""
    num_gpus: int
    """GPUs of the cluster: the per-GPU figures divide by this."""
    layout: str
    """The cluster's layout, a label for summaries and plots (e.g. colocated-c2048, 1P:1D)."""
    target: float
    """Attainment the knee must reach."""
    percentiles: tuple[float, ...]
    """Latency percentiles of each rate's metrics."""


def run_rate(
    rate: float, workload_at: WorkloadAt, config: RunConfig, processes: int, sweep: SweepConfig
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """One rate: its workload sent, requests past the drain deadline cut off; its figures and records."""
    deadline = dataclasses.replace(config, deadline_s=sweep.window.end_s + sweep.drain_s)
    records = run_in_processes(workload_at(rate), deadline, processes)
    return rate_result(rate, records, sweep.window, sweep.slos, sweep.num_gpus, sweep.percentiles), records


OnRate = Callable[[dict[str, Any], list[RequestRecord]], None]


def run_sweep(
    workload_at: WorkloadAt, config: RunConfig, processes: int, sweep: SweepConfig, on_rate: OnRate
) -> list[dict[str, Any]]:
    """Every listed rate, then the bisection; on_rate sees each rate's result and records as it finishes."""
    results: list[dict[str, Any]] = []

    def measure(rate: float) -> float:
        if results:
            time.sleep(COOLDOWN_S)
        result, records = run_rate(rate, workload_at, config, processes, sweep)
        results.append(result)
        on_rate(result, records)
        return float(result["slo_attainment"])

    for rate in sweep.rates:
        measure(rate)
    if sweep.search is not None:
        search_rates(measure, sweep.search, sweep.target)
    return results


def rate_path(result_json: str | Path, rate: float) -> Path:
    """Where one rate's JSON goes: beside the summary, e.g. serving.json -> serving.rate-2.json."""
    path = Path(result_json)
    return path.with_name(f"{path.stem}.rate-{rate:g}{path.suffix or '.json'}")


def rate_report(
    config: Mapping[str, Any], result: Mapping[str, Any], records: Sequence[RequestRecord], sweep: SweepConfig,
    detailed: bool,
) -> dict[str, Any]:  # fmt: skip
    """One rate's JSON: the run's config, its figures, metrics by tag over the window, records when detailed."""
    window = sweep.window.select(records)
    by_tag = {t: m for t, m in metrics_by_tag(window, sweep.percentiles, sweep.slos or None).items()}
    report = {"config": dict(config), **result, "metrics_by_tag": by_tag}
    if detailed:
        report["requests"] = [record_json(r) for r in records]
    return report


def sweep_report(config: Mapping[str, Any], results: Sequence[Mapping[str, Any]], sweep: SweepConfig) -> dict[str, Any]:
    """The summary JSON: the config, the summary (rows and knee) and each rate's full figures."""
    summ = summary(results, sweep.slos, sweep.num_gpus, sweep.layout, sweep.target)
    return {"config": dict(config), "sweep": summ, "runs": list(results)}


def print_sweep(report: Mapping[str, Any]) -> None:
    print(format_summary(report["sweep"]))
