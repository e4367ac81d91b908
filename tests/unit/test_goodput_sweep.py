"""Goodput sweeps on synthetic timestamps: the window, attainment (every SLO, failures not good), goodput per GPU,
the itl_p99 SLO kind, the knee and its interpolation, the bisection, the sweep CLI's flags and summary plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdserve.router.benchmark import cli
from pdserve.router.benchmark.metrics import RequestRecord, meets_slos, parse_goodput
from pdserve.router.benchmark.sweep import (
    RateSearch,
    Window,
    find_knee,
    parse_rates,
    rate_result,
    search_rates,
    summary,
)
from pdserve.router.benchmark.sweep_plots import SWEEP_PLOT_FILES, load_sweeps, write_sweep_plots
from pdserve.router.benchmark.sweep_run import rate_path


def record(index: int, send: float, ttft: float, gaps: list[float], error: str | None = None) -> RequestRecord:
    """A request sent at `send` whose first token came ttft later and the next ones after each gap (seconds)."""
    times = [send + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    if error is not None:
        return RequestRecord(index, "t", send, send + 1.0, error=error)
    return RequestRecord(index, "t", send, times[-1], tuple(times), (1,) * len(times), 10, 0, len(times), "length")


def test_window_keeps_requests_sent_inside_it() -> None:
    records = [record(i, t, 0.1, [0.01]) for i, t in enumerate([0.5, 2.0, 3.9, 4.0, 6.0])]
    window = Window(warmup_s=1.0, duration_s=3.0)
    assert [r.send_time for r in window.select(records)] == [2.0, 3.9]
    assert window.end_s == 4.0


def test_rate_result_counts_good_requests_over_the_window() -> None:
    window = Window(1.0, 4.0)
    records = [
        record(0, 0.5, 5.0, [0.5]),  # warm-up: left out even though it is slow
        record(1, 1.0, 0.2, [0.01, 0.01]),  # good
        record(2, 2.0, 0.9, [0.01]),  # TTFT 900 ms > 500: not good
        record(3, 3.0, 0.1, [0.05, 0.05]),  # TPOT 50 ms > 20: not good
        record(4, 4.0, 0.1, [], error="DEADLINE: cut off"),  # failed: not good, still sent
    ]
    result = rate_result(2.0, records, window, {"ttft": 500.0, "tpot": 20.0}, num_gpus=2)
    assert result["num_requests"] == 4 and result["num_good"] == 1
    assert result["slo_attainment"] == 0.25
    assert result["slo_attainment_by_kind"] == {"ttft": 0.5, "tpot": 0.5}
    assert result["goodput"] == pytest.approx(1 / 4.0) and result["goodput_per_gpu"] == pytest.approx(1 / 8.0)
    assert result["metrics"]["completed"] == 3 and result["metrics"]["failed"] == 1
    assert result["metrics"]["request_goodput"] == pytest.approx(result["goodput"])
    assert result["request_throughput_per_gpu"] == pytest.approx(3 / 4.0 / 2)


def test_itl_p99_is_an_slo_kind_over_a_requests_own_gaps() -> None:
    assert parse_goodput(["itl_p99:50", "ttft:1000"]) == {"itl_p99": 50.0, "ttft": 1000.0}
    steady = record(0, 0.0, 0.1, [0.02] * 200)
    spiky = record(1, 0.0, 0.1, [0.02] * 195 + [0.2] * 5)  # 2.5% of its gaps are 200 ms: its p99 gap is too
    assert meets_slos(steady, {"itl_p99": 50.0}) and not meets_slos(spiky, {"itl_p99": 50.0})
    assert meets_slos(spiky, {"tpot": 50.0})  # NOTE: the mean hides what the p99 shows
    with pytest.raises(ValueError):
        parse_goodput(["itl:50"])


def results_of(attainments: dict[float, float]) -> list[dict[str, float]]:
    return [{"request_rate": r, "slo_attainment": a, "goodput_per_gpu": r * a / 2} for r, a in attainments.items()]


def test_knee_is_the_highest_rate_at_target_with_the_crossing_interpolated() -> None:
    knee = find_knee(results_of({8.0: 0.5, 2.0: 1.0, 4.0: 0.95}))
    assert knee.rate == 4.0 and knee.goodput_per_gpu == pytest.approx(1.9)
    assert knee.interpolated == pytest.approx(4.0 + (0.95 - 0.9) / (0.95 - 0.5) * 4.0)
    assert find_knee(results_of({2.0: 0.95, 4.0: 0.92})) == (4.0, 4.0, pytest.approx(1.84))
    assert find_knee(results_of({2.0: 0.8, 4.0: 0.3})) == (None, None, None)


def test_bisection_narrows_the_knee_between_lo_and_hi() -> None:
    measured: list[float] = []

    def measure(rate: float) -> float:
        measured.append(rate)
        return 1.0 if rate <= 5.3 else 0.4

    search_rates(measure, RateSearch(1.0, 9.0, 3))
    assert measured == [1.0, 9.0, 5.0, 7.0, 6.0]
    knee = find_knee(results_of({r: 1.0 if r <= 5.3 else 0.4 for r in measured}))
    assert knee.rate == 5.0


def test_bisection_stops_when_the_knee_is_outside_the_range() -> None:
    measured: list[float] = []
    search_rates(lambda r: measured.append(r) or 0.5, RateSearch(1.0, 9.0, 3))  # type: ignore[func-returns-value]
    assert measured == [1.0]
    measured.clear()
    search_rates(lambda r: measured.append(r) or 1.0, RateSearch(1.0, 9.0, 3))  # type: ignore[func-returns-value]
    assert measured == [1.0, 9.0]


def test_rates_and_searches_parse_or_say_why() -> None:
    assert parse_rates("2,4,8") == [2.0, 4.0, 8.0] and parse_rates("inf") == [math.inf]
    assert RateSearch.parse("1,16,4") == RateSearch(1.0, 16.0, 4)
    for bad in ("0,2", "-1"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    for bad in ("4,1,2", "1,2", "a,b,c"):
        with pytest.raises(ValueError):
            RateSearch.parse(bad)


def test_cli_runs_a_sweep_for_rate_lists_and_sampled_datasets_only() -> None:
    args = cli.parse_args(["--request-rate", "2,4,8", "--goodput", "ttft:1000", "tpot:15"])
    assert args.sweep and args.request_rates == [2.0, 4.0, 8.0] and args.request_rate == 2.0
    assert args.duration == 60.0 and args.warmup == 10.0
    assert not cli.parse_args(["--request-rate", "4"]).sweep  # NOTE: one rate of --num-prompts requests, as before
    assert cli.parse_args(["--dataset", "chat", "--request-rate", "3"]).sweep
    searched = cli.parse_args(["--dataset", "long-input", "--rate-search", "0.5,4,3"])
    assert searched.request_rates == [] and searched.search == RateSearch(0.5, 4.0, 3)
    for bad in (
        ["--dataset", "shared-prefix", "--request-rate", "2,4"],
        ["--dataset", "chat"],  # NOTE: inf is no sweep rate
        ["--dataset", "jsonl", "--request-rate", "2"],
    ):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)


def test_summary_table_and_plots_one_line_per_layout(tmp_path: Path) -> None:
    window, slos = Window(0.0, 10.0), {"ttft": 500.0}
    paths = []
    for layout, ttft in (("colocated-c2048", 0.6), ("1P:1D", 0.2)):
        results = [rate_result(r, [record(i, i * 0.5, ttft * r, [0.01]) for i in range(20)], window, slos, 2)
                   for r in (1.0, 2.0)]  # fmt: skip
        path = tmp_path / f"{layout.replace(':', '')}.json"
        path.write_text(json.dumps({"sweep": summary(results, slos, 2, layout, 0.9)}))
        paths.append(path)
    sweeps = load_sweeps(paths)
    assert [s["knee"]["rate"] for s in sweeps] == [None, 2.0]
    assert sweeps[1]["rates"][0]["goodput_per_gpu"] == pytest.approx(20 / 10 / 2)
    pytest.importorskip("matplotlib")
    written = write_sweep_plots(sweeps, tmp_path / "plots")
    assert [p.name for p in written] == list(SWEEP_PLOT_FILES) and all(p.stat().st_size > 1000 for p in written)
    assert cli.main(["--plot", str(tmp_path / "again"), "--plot-from", *map(str, paths)]) == 0
    assert (tmp_path / "again" / SWEEP_PLOT_FILES[1]).exists()


def test_each_rate_writes_beside_the_summary() -> None:
    assert rate_path("out/serving.json", 2.0) == Path("out/serving.rate-2.json")
    assert rate_path("out/s.json", 0.25) == Path("out/s.rate-0.25.json")


def test_a_saved_sweep_is_rescored_under_other_slos(tmp_path: Path) -> None:
    from pdserve.router.benchmark.metrics import record_json
    from pdserve.router.benchmark.rescore import rescore

    window, records = Window(0.0, 10.0), [record(i, i * 0.5, 0.1 + 0.05 * i, [0.01]) for i in range(20)]
    result = rate_result(2.0, records, window, {"ttft": 10_000.0}, 2)
    config = {"sweep": {"warmup": 0.0, "duration": 10.0}}
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"config": config, "sweep": summary([result], {"ttft": 10_000.0}, 2, "1P:1D", 0.9)}))
    rate_path(path, 2.0).write_text(json.dumps({**result, "requests": [record_json(r) for r in records]}))
    tight = rescore(path, {"ttft": 500.0})
    assert tight["sweep"]["rates"][0]["slo_attainment"] == 9 / 20  # TTFT 100 + 50 i ms <= 500 for i <= 8
    assert tight["sweep"]["layout"] == "1P:1D" and tight["sweep"]["slos_ms"] == {"ttft": 500.0}
