"""pdserve-bench-serving: vLLM metric definitions on hand-made timestamps, arrivals, dataset shapes."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pdserve.router.benchmark import datasets as ds
from pdserve.router.benchmark.metrics import (
    RequestRecord,
    build_report,
    compute_metrics,
    format_table,
    parse_goodput,
    parse_percentiles,
    record_from_json,
    record_json,
)
from pdserve.router.tokenizer import RouterTokenizer
from tests.models import TINY_LLAMA_EOS_ID, TINY_LLAMA_VOCAB_SIZE

VOCAB = ds.VocabInfo(TINY_LLAMA_VOCAB_SIZE, (TINY_LLAMA_EOS_ID, 7))


def synthetic_records() -> list[RequestRecord]:
    """Three completed requests and one that failed after a response (times in seconds)."""
    r0 = RequestRecord(0, "a", 0.0, 0.3, (0.1, 0.15, 0.25, 0.3), (1, 1, 2, 1), 10, 4, 5)
    r1 = RequestRecord(1, "b", 0.5, 0.9, (0.7, 0.9), (1, 1), 20, 0, 2)
    r2 = RequestRecord(2, "a", 1.0, 1.3, (1.3,), (1,), 5, 0, 1)
    failed = RequestRecord(3, "b", 0.2, 1.2, (0.25,), (1,), 99, 0, 8, error="UNAVAILABLE: decode worker died")
    return [r0, r1, r2, failed]


def test_per_request_ttft_tpot_itl_e2el() -> None:
    r0, r1, r2, failed = synthetic_records()
    assert (r0.ttft, r0.e2el, r0.output_tokens) == (0.1, 0.3, 5)
    assert r0.tpot == pytest.approx(0.2 / 4)  # (E2EL - TTFT) / (output_tokens - 1): 5 tokens in 4 responses
    assert r0.itls == pytest.approx([0.05, 0.1, 0.05])  # gaps between responses, not per token
    assert r1.tpot == pytest.approx(0.2)
    assert r2.tpot is None and r2.itls == []
    assert not failed.ok and r0.ok


def test_compute_metrics_exact_values() -> None:
    m = compute_metrics(synthetic_records(), percentiles=[50, 90, 99])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"], m["total_cached_tokens"]) == (35, 8, 4)
    assert m["duration"] == pytest.approx(1.3)  # first send (0.0) -> last stream end (1.3)
    assert m["request_throughput"] == pytest.approx(3 / 1.3)
    assert m["output_throughput"] == pytest.approx(8 / 1.3)
    assert m["total_token_throughput"] == pytest.approx(43 / 1.3)
    assert m["request_goodput"] is None
    expected = {
        # TTFT ms [100, 200, 300]
        "mean_ttft_ms": 200.0, "median_ttft_ms": 200.0, "std_ttft_ms": (20000 / 3) ** 0.5,
        "p50_ttft_ms": 200.0, "p90_ttft_ms": 280.0, "p99_ttft_ms": 298.0,
        # TPOT ms [50, 200] (r2 has one token)
        "mean_tpot_ms": 125.0, "median_tpot_ms": 125.0, "std_tpot_ms": 75.0, "p90_tpot_ms": 185.0,
        # ITL ms pooled over requests [50, 100, 50, 200]; the failed request's gaps are excluded
        "mean_itl_ms": 100.0, "median_itl_ms": 75.0, "p99_itl_ms": 197.0,
        # E2EL ms [300, 400, 300]
        "mean_e2el_ms": 1000 / 3, "median_e2el_ms": 300.0, "p90_e2el_ms": 380.0,
    }  # fmt: skip
    for key, value in expected.items():
        assert m[key] == pytest.approx(value), key


def test_ttft_outside_the_server_subtracts_its_arrival_to_first_token() -> None:
    """TTFT minus timings.first_token_ms: the call's way in plus the first token's way back to the client."""
    r0, r1, r2, failed = synthetic_records()
    r0 = dataclasses.replace(r0, server_timings={"first_token_ms": 40.0})  # TTFT 100 ms -> 60 outside
    r1 = dataclasses.replace(r1, server_timings={"first_token_ms": 150.0})  # TTFT 200 ms -> 50 outside
    assert r0.ttft_outside == pytest.approx(0.06) and r1.ttft_outside == pytest.approx(0.05)
    assert r2.ttft_outside is None  # no server timings: left out, not counted as 0
    m = compute_metrics([r0, r1, r2, failed], percentiles=[50])
    assert m["mean_ttft_outside_ms"] == pytest.approx(55.0) and m["p50_ttft_outside_ms"] == pytest.approx(55.0)
    assert compute_metrics([r2], percentiles=[50])["mean_ttft_outside_ms"] == 0.0


def test_failed_requests_do_not_change_latency_stats() -> None:
    records = synthetic_records()
    with_failed, without = compute_metrics(records), compute_metrics(records[:3])
    for key in with_failed:
        if key.endswith("_ms") or key.startswith("total_"):
            assert with_failed[key] == without[key], key


@pytest.mark.parametrize(
    ("slos", "num_good"),
    [
        (["ttft:250"], 2),  # r0 100 ms, r1 200 ms; r2 300 ms misses
        (["tpot:100"], 2),  # r0 50 ms, r2 counts as 0 (one token); r1 200 ms misses
        (["e2el:350"], 2),  # r0 300, r2 300; r1 400 misses
        (["ttft:250", "tpot:100"], 1),  # every SLO must hold: only r0
        (["ttft:50"], 0),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos: list[str], num_good: int) -> None:
    m = compute_metrics(synthetic_records(), slos=parse_goodput(slos))
    assert m["request_goodput"] == pytest.approx(num_good / 1.3)


def test_parse_goodput_and_percentiles() -> None:
    assert parse_goodput(["ttft:500", "e2el:2000.5"]) == {"ttft": 500.0, "e2el": 2000.5}
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    assert "p99.9_ttft_ms" in compute_metrics(synthetic_records(), percentiles=[99.9])
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])


def test_report_has_overall_per_tag_and_detailed_sections() -> None:
    report = build_report({"backend": "x"}, synthetic_records(), [50, 99], None, detailed=True)
    assert set(report) == {"config", "metrics", "metrics_by_tag", "requests"}
    assert set(report["metrics_by_tag"]) == {"a", "b"}
    assert report["metrics_by_tag"]["a"]["completed"] == 2
    # NOTE: per-tag throughputs use the whole run's duration, so they add up.
    tags = report["metrics_by_tag"].values()
    assert sum(t["output_throughput"] for t in tags) == pytest.approx(report["metrics"]["output_throughput"])
    assert report["requests"][0]["ttft_ms"] == pytest.approx(100.0)
    assert "Median TTFT (ms):" in format_table(report["metrics"], [50, 99])


def test_gamma_arrivals_have_mean_one_over_rate() -> None:
    for burstiness in (1.0, 0.5, 4.0):
        gaps = np.diff(ds.arrival_offsets(40_000, 4.0, burstiness, seed=3))
        assert gaps.mean() == pytest.approx(0.25, rel=0.03)
        assert gaps.std() / gaps.mean() == pytest.approx(burstiness**-0.5, rel=0.05)  # gamma CV = 1/sqrt(shape)
    first = ds.arrival_offsets(100, 2.0, 1.0, seed=3)
    assert first[0] == 0.0 and np.all(np.diff(first) > 0)
    assert np.array_equal(first, ds.arrival_offsets(100, 2.0, 1.0, seed=3))
    assert not np.array_equal(first, ds.arrival_offsets(100, 2.0, 1.0, seed=4))
    assert np.array_equal(ds.arrival_offsets(5, float("inf"), 1.0, seed=0), np.zeros(5))


def test_random_dataset_lengths_in_range_without_eos() -> None:
    specs = ds.random_dataset(VOCAB, 200, (3, 9), (2, 5), seed=1)
    assert len(specs) == 200
    assert {s.prompt_len for s in specs} == set(range(3, 10))
    assert {s.output_len for s in specs} == set(range(2, 6))
    ids = {i for s in specs for i in s.prompt_ids}
    assert ids.isdisjoint({TINY_LLAMA_EOS_ID, 7}) and max(ids) < TINY_LLAMA_VOCAB_SIZE
    assert specs == ds.random_dataset(VOCAB, 200, (3, 9), (2, 5), seed=1)
    assert ds.parse_range("7") == (7, 7) and ds.parse_range("3:9") == (3, 9)


def test_shared_prefix_dataset_shares_prefixes_within_groups() -> None:
    specs = ds.shared_prefix_dataset(VOCAB, 12, 3, prefix_len=20, suffix_len=5, output_len=(30, 30), seed=2)
    assert all(s.prompt_len == 25 and s.output_len == 30 for s in specs)
    prefixes = Counter(s.prompt_ids[:20] for s in specs)
    assert sorted(prefixes.values()) == [4, 4, 4]
    assert len({s.prompt_ids[20:] for s in specs}) == 12
    group_order = [list(prefixes).index(s.prompt_ids[:20]) for s in specs]
    assert group_order != [k % 3 for k in range(12)]  # shuffled across groups


def test_long_prompt_workload_poisson_longs_and_closed_loop_shorts() -> None:
    w = ds.long_prompt_workload(VOCAB, 4, (32, 256), (400, 16), long_rate=2.0, duration_s=100.0, seed=5)
    times = [s.start_time or 0.0 for s in w.requests]
    assert 150 < len(times) < 250 and all(0 < t < 100 for t in times) and times == sorted(times)
    assert all((s.tag, s.prompt_len, s.output_len) == ("long", 400, 16) for s in w.requests)
    assert w.closed_loop is not None and w.closed_loop.num_streams == 4
    short = w.closed_loop.spec(3)
    assert (short.tag, short.prompt_len, short.output_len) == ("short", 32, 256)
    assert short == w.closed_loop.spec(3) and short != w.closed_loop.spec(4)


def test_allowed_ids_are_made_once_per_vocabulary_and_read_only() -> None:
    """The closed loop draws a prompt per request inside the client's event loop: the allowed-id table (a
    setdiff1d over the vocabulary) must not be rebuilt each time (it stalled every stream of the process)."""
    big = ds.VocabInfo(128256, (128001, 128009))
    first = big.allowed_ids()
    assert big.allowed_ids() is first and ds.VocabInfo(128256, (128001, 128009)).allowed_ids() is first
    assert len(first) == 128254 and 128001 not in first and not first.flags.writeable
    loop = ds.ClosedLoop(4, 1.0, 32, 8, big, seed=3)
    assert loop.spec(5) == loop.spec(5) and loop.spec(5) != loop.spec(6)
    assert all(0 <= i < 128256 and i not in (128001, 128009) for i in loop.spec(7).prompt_ids)


def test_duplicate_dataset_alternates_text_and_equal_ids(tiny_llama_dir: Path) -> None:
    tokenizer = RouterTokenizer.from_dir(tiny_llama_dir)
    specs = ds.duplicate_dataset(tokenizer, TINY_LLAMA_VOCAB_SIZE, 3, 4, (5, 12), (8, 8), seed=6)
    assert [s.send_as for s in specs] == ["text", "ids"] * 6
    for g in range(3):
        group = specs[4 * g : 4 * g + 4]
        assert len({s.text for s in group}) == 1 and len({s.prompt_ids for s in group}) == 1
        text = group[0].text
        assert text is not None and tokenizer.encode(text) == list(group[1].prompt_ids)
        assert 5 <= len(text.split()) <= 12
    assert len({s.text for s in specs}) == 3


def test_saved_records_round_trip_through_json() -> None:
    import json

    rec = RequestRecord(0, "short", 0.5, 1.0, (0.6, 0.8, 1.0), (1, 2, 1), 12, 4, 4, "length", None, {"queue_ms": 1.5})
    again = record_from_json(json.loads(json.dumps(record_json(rec))))
    assert again == rec and again.itls == rec.itls


def test_a_workload_splits_over_client_processes_without_loss_or_shared_prompts() -> None:
    from pdserve.router.benchmark.runner import shard

    workload = ds.long_prompt_workload(VOCAB, num_short=5, short_io=(8, 16), long_io=(64, 4), long_rate=3.0,
                                       duration_s=10.0, seed=3)  # fmt: skip
    parts = [shard(workload, k, 2) for k in range(2)]
    got = sorted((r for p in parts for r in p.requests), key=lambda r: r.start_time or 0.0)
    assert len(workload.requests) > 10 and got == sorted(workload.requests, key=lambda r: r.start_time or 0.0)
    loops = [p.closed_loop for p in parts]
    assert [lp.num_streams for lp in loops if lp] == [3, 2]
    assert loops[0] is not None and loops[1] is not None and loops[0].spec(0) != loops[1].spec(0)
