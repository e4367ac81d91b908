"""The planner's model on synthetic profiles: interpolation, layouts and their cluster flags, exact single-request
timelines through each worker kind, and a prefill-bound and a decode-bound case picking different layouts."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.router.benchmark.lengths import WORKLOADS
from pdserve.router.plan import cli
from pdserve.router.plan.layouts import colocated, disaggregated, layouts_for
from pdserve.router.plan.profile import Profile, interpolate
from pdserve.router.plan.search import DRAW_BLOCK, PlanConfig, Trace, find_goodput
from pdserve.router.plan.simulate import SimConfig, SimRequest, StepCost, simulate


def profile_doc(pre_per_token: float, pre_fixed: float, dec_fixed: float, dec_per_seq: float, gpus: int = 3) -> dict:
    """Prefill ms = fixed + per_token * tokens; decode step ms = fixed + per_seq * batch (no context term)."""
    pre = [{"tokens": t, "ms": pre_fixed + pre_per_token * t} for t in (64, 4096)]
    dec = [{"batch": b, "context": c, "ms": dec_fixed + dec_per_seq * b} for b in (1, 128) for c in (128, 4096)]
    return {"version": 1, "gpu": "synthetic", "num_gpus": gpus, "prefill": {"budget": 4096, "points": pre},
            "decode": {"points": dec}, "handoff": {"fixed_ms": 2.0, "ms_per_token": 0.0}}  # fmt: skip


PREFILL_BOUND = profile_doc(0.5, 5.0, 3.0, 0.01)
"""Prompts cost 0.5 ms a token, a decode step ~3 ms: a prefill chunk stalls the decodes it rides with."""
DECODE_BOUND = profile_doc(0.01, 5.0, 10.0, 0.5)
"""Prompts are cheap, a decode step costs 10 + 0.5 ms per sequence."""


def test_interpolation_is_piecewise_linear_and_extrapolates_the_end_segments() -> None:
    xs, ys = [10.0, 20.0, 40.0], [1.0, 3.0, 4.0]
    assert [interpolate(xs, ys, x) for x in (10, 15, 30, 40)] == [1.0, 2.0, 3.5, 4.0]
    assert interpolate(xs, ys, 80) == 6.0 and interpolate(xs, ys, 5) == 0.0 and interpolate([1], [7], 9) == 7.0


def test_profile_round_trips_and_rejects_a_grid_with_holes() -> None:
    profile = Profile.from_json(DECODE_BOUND | {"mps_slowdown": {"decode": {"50": 1.25}}})
    assert Profile.from_json(profile.to_json()) == profile
    assert profile.decode_time(64, 1000) == pytest.approx(10 + 0.5 * 64)
    assert profile.prefill_time(1000) == pytest.approx(5 + 10)
    assert profile.slowdown("decode", 0.5) == 1.25 and profile.slowdown("prefill", 0.5) == 2.0
    assert profile.slowdown("decode", 1.0) == 1.0
    busy = Profile.from_json(DECODE_BOUND | {"mps_slowdown": {"decode": {"50": 1.25}, "with_other": {
        "decode": {"30": 2.5, "70": 1.5}}}})  # fmt: skip
    assert Profile.from_json(busy.to_json()) == busy
    assert busy.slowdown("decode", 0.5) == pytest.approx(2.0)  # measured with the other role busy: it stands
    assert busy.slowdown("decode", 0.9) == 1.5 and busy.slowdown("decode", 0.1) == 2.5  # held beyond the ends
    assert busy.slowdown("prefill", 0.5) == 2.0 and busy.slowdown("decode", 1.0) == 1.0
    holes = dict(DECODE_BOUND, decode={"points": DECODE_BOUND["decode"]["points"][:-1]})
    with pytest.raises(ValueError, match="every batch x context"):
        Profile.from_json(holes)
    with pytest.raises(ValueError, match="version"):
        Profile.from_json(DECODE_BOUND | {"version": 9})


def test_long_prompts_pay_the_measured_whole_prompt_time_over_their_chunks() -> None:
    doc = dict(PREFILL_BOUND, prefill={"budget": 1000, "points": [{"tokens": 1000, "ms": 100.0},
                                                                  {"tokens": 4000, "ms": 700.0}]})  # fmt: skip
    profile = Profile.from_json(doc)
    assert profile.prefix_cost(1000, 0) == 0.0 and profile.prefix_cost(1000, 3000) == pytest.approx(100.0)
    req = simulate(disaggregated(1, 1, 2, (50, 50)), StepCost(profile), [SimRequest(0.0, 4000, 1)], SimConfig())[0]
    assert req.first_token == pytest.approx(0.7) and req.done == req.first_token  # its chunks add up to 700 ms


CHUNKS = [{"tokens": c, "prefix": p, "ms": ms} for c, p, ms in
          [(512, 0, 10.0), (512, 2048, 14.0), (2048, 0, 40.0), (2048, 2048, 48.0), (2048, 4096, 60.0)]]  # fmt: skip


def test_measured_chunks_price_a_chunk_by_its_prefix() -> None:
    profile = Profile.from_json(DECODE_BOUND | {"chunks": {"points": CHUNKS}})
    assert Profile.from_json(profile.to_json()) == profile
    assert profile.prefix_cost(512, 0) == 0.0 and profile.prefix_cost(512, 1024) == pytest.approx(2.0)
    assert profile.prefix_cost(2048, 3072) == pytest.approx(14.0)  # between its 2048 and 4096 points
    assert profile.prefix_cost(1280, 2048) == pytest.approx(6.0)  # halfway between the chunk sizes
    assert profile.prefix_cost(256, 2048) == pytest.approx(2.0)  # towards 0 at 0 tokens
    tp2 = Profile.from_json(DECODE_BOUND | {"chunks": {"points": CHUNKS}, "tp": {"2": DECODE_BOUND}}).at_tp(2)
    assert tp2.prefix_cost(512, 1024) == pytest.approx(1.0)  # the heads split over two ranks
    alone = Profile.from_json(DECODE_BOUND | {"chunks": {"points": [*CHUNKS, {"tokens": 4096, "prefix": 0, "ms": 90}]}})
    assert alone.prefix_cost(4096, 2048) == pytest.approx(8.0 + 4.0 * 2048 / 1536)  # 512 and 2048's line: no prefix
    with pytest.raises(ValueError, match=re.escape("chunk sizes [512] have no point at prefix 0")):
        Profile.from_json(DECODE_BOUND | {"chunks": {"points": CHUNKS[1:]}})


def test_a_colocated_prompt_pays_each_chunks_prefix() -> None:
    """Two 512-token chunks alone on a colocated worker: the second runs at prefix 512 and pays its prefix cost."""
    doc = DECODE_BOUND | {"chunks": {"points": CHUNKS}}
    req = simulate(colocated(1, 512), StepCost(Profile.from_json(doc)), [SimRequest(0.0, 1024, 1)], SimConfig())[0]
    chunk = 5.0 + 0.01 * 512
    assert req.first_token == pytest.approx((2 * chunk + 1.0) / 1e3)  # 4 ms over 2048 tokens of prefix: 1 at 512
    bare = simulate(colocated(1, 512), StepCost(Profile.from_json(DECODE_BOUND)), [SimRequest(0.0, 1024, 1)],
                    SimConfig())[0]  # fmt: skip
    assert bare.first_token == pytest.approx(2 * chunk / 1e3)  # whole prompts: a linear prefill has no prefix cost


def test_a_colocated_pass_carrying_a_chunk_costs_the_chunk_points_level() -> None:
    """A chunk pass measured 3 ms over a whole 512-token prompt (10.12 ms) and level with one of 2048: every
    colocated pass carrying prompt tokens pays that, by its tokens; the prefill worker's passes do not."""
    slow = [{"tokens": 512, "prefix": 0, "ms": 13.12}, {"tokens": 2048, "prefix": 0, "ms": 5.0 + 0.01 * 2048}]
    profile = Profile.from_json(DECODE_BOUND | {"chunks": {"points": slow}, "tp": {"2": DECODE_BOUND}})
    assert [profile.chunk_pass_extra(n) for n in (512, 1280, 2048, 4096)] == pytest.approx([3.0, 1.5, 0.0, 0.0])
    assert profile.chunk_pass_extra(256) == pytest.approx(3.0)  # NOTE: held below the smallest size, not extended
    assert profile.at_tp(2).chunk_pass_extra(512) == 0.0
    below = [{"tokens": 512, "prefix": 0, "ms": 13.12}, {"tokens": 2048, "prefix": 0, "ms": 5.0 + 0.01 * 2048 - 0.6}]
    dipped = Profile.from_json(DECODE_BOUND | {"chunks": {"points": below}})
    assert dipped.chunk_pass_extra(2048) == 0.0 and dipped.chunk_pass_extra(1280) == pytest.approx(1.5)
    cost = StepCost(profile)
    alone = simulate(colocated(1, 512), cost, [SimRequest(0.0, 512, 1)], SimConfig())[0]
    assert alone.first_token == pytest.approx(13.12 / 1e3)
    beside = cost.mixed(500, 12, 1000.0, 0.0) * 1e3  # 12 decodes fill the pass to 512 tokens
    assert beside == pytest.approx(10 + 0.5 * 12 + 0.01 * 500 + 3.0)
    handed = simulate(disaggregated(1, 1, 2, (50, 50)), cost, [SimRequest(0.0, 512, 1)], SimConfig())[0]
    assert handed.first_token == pytest.approx(10.12 / 1e3)


def test_layouts_of_two_gpus_and_their_cluster_flags() -> None:
    names = [layout.name for layout in layouts_for(2)]
    assert names == ["colocated-c512", "colocated-c2048", "1P:1D", "1P:2D-shared", "2P:1D-shared"]
    assert [layout.name for layout in layouts_for(1)] == ["colocated-c512", "colocated-c2048", "1P:1D-shared"]
    assert len(layouts_for(4)) == 2 + 3 + 4
    assert colocated(2, 512).cluster_flags(64) == [
        "--max-num-seqs", "64", "--colocated", "--decode", "2", "--decode-gpus", "0,1",
        "--max-num-batched-tokens", "512", "--prefill-chunk-size", "512",
    ]  # fmt: skip
    shared = disaggregated(2, 1, 2, (70, 30))
    assert shared.cluster_flags(128)[2:] == [
        "--prefill", "2", "--decode", "1", "--prefill-gpus", "0,1", "--decode-gpus", "1", "--mps-split", "70/30",
    ]  # fmt: skip
    assert [w.sm_share for w in shared.prefill] == [1.0, 0.7] and shared.decode[0].kv_share == 0.5  # GPU 0 alone
    assert disaggregated(1, 1, 2, (50, 50)).cluster_flags(8)[-4:] == ["--prefill-gpus", "0", "--decode-gpus", "1"]


def test_one_request_through_prefill_handoff_and_decode_steps() -> None:
    cost = StepCost(Profile.from_json(DECODE_BOUND))
    req = simulate(disaggregated(1, 1, 2, (50, 50)), cost, [SimRequest(1.0, 1000, 5)], SimConfig())[0]
    assert req.ttft == pytest.approx(0.015)  # prefill 5 + 0.01 * 1000 ms
    step = (10 + 0.5) / 1e3
    assert req.done == pytest.approx(1.015 + 0.002 + 4 * step)  # handoff, then 4 decode steps at batch 1
    assert req.tpot == pytest.approx((0.002 + 4 * step) / 4) and req.itl_p99() == pytest.approx(0.002 + step, rel=0.1)


def test_colocated_prefills_in_chunks_then_decodes_one_token_a_step() -> None:
    cost = StepCost(Profile.from_json(PREFILL_BOUND))
    req = simulate(colocated(1, 512), cost, [SimRequest(0.0, 1200, 3)], SimConfig())[0]
    chunks = (5 + 0.5 * 512) * 2 + (5 + 0.5 * 176)  # three chunk steps, alone
    assert req.first_token == pytest.approx(chunks / 1e3)
    assert req.done == pytest.approx((chunks + 2 * (3 + 0.01)) / 1e3)


def test_mps_share_slows_a_shared_layouts_workers() -> None:
    cost = StepCost(Profile.from_json(DECODE_BOUND))
    req = simulate(disaggregated(1, 1, 1, (50, 50)), cost, [SimRequest(0.0, 1000, 2)], SimConfig())[0]
    assert req.ttft == pytest.approx(0.030) and req.done == pytest.approx(0.030 + 0.002 + 2 * 0.0105)


def test_decode_batch_waits_for_kv_room() -> None:
    doc = DECODE_BOUND | {"kv_capacity_tokens": 1500}
    reqs = [SimRequest(0.0, 1000, 3), SimRequest(0.0, 1000, 3)]
    done = simulate(disaggregated(1, 1, 2, (50, 50)), StepCost(Profile.from_json(doc)), reqs, SimConfig())
    assert done[1].done - done[0].done == pytest.approx(2 * 0.0105, rel=0.05)  # NOTE: the second runs after the first
    assert all(not math.isnan(r.done) for r in done)


def run_plan(doc: dict[str, Any], tmp_path: Path, workload: str, slo: str) -> dict[str, Any]:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    args = cli.build_parser().parse_args(["--profile", str(path), "--workload", workload, "--slo", slo,
                                          "--duration-s", "10"])  # fmt: skip
    return cli.plan(args)


def test_prefill_bound_and_decode_bound_pick_different_layouts(tmp_path: Path) -> None:
    prefill_bound = run_plan(PREFILL_BOUND, tmp_path, "long-input", "ttft:10000,itl_p99:50")
    decode_bound = run_plan(DECODE_BOUND, tmp_path, "chat", "ttft:2000,tpot:25")
    # NOTE: more prefill than decode workers (3P:1D-shared: only the shared GPU is split, the others whole)
    prefill_workers, decode_workers = (int(n) for n in re.findall(r"(\d+)[PD]", prefill_bound["recommended"]))
    assert prefill_workers > decode_workers and prefill_bound["ratio_to_best_colocated"] > 1.1
    rows = {r["layout"]: r for r in prefill_bound["layouts"]}
    assert rows["colocated-c2048"]["breaks_first"] == "itl_p99" and rows["2P:1D"]["breaks_first"] == "ttft"
    assert rows["2P:1D"]["goodput"] > 2 * rows["1P:2D"]["goodput"]  # NOTE: prompts need the second prefill GPU
    assert decode_bound["recommended"].startswith("colocated")
    rows = {r["layout"]: r for r in decode_bound["layouts"]}
    assert rows["1P:2D"]["goodput"] > 2 * rows["2P:1D"]["goodput"] and rows["2P:1D"]["breaks_first"] == "tpot"
    assert decode_bound["cluster_flags"][2] == "--colocated"


def test_an_unmeetable_slo_recommends_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_plan(PREFILL_BOUND, tmp_path, "long-input", "ttft:100,tpot:50")  # NOTE: a 4000-token prompt takes 2 s
    assert doc["recommended"] is None and all(r["goodput"] == 0 for r in doc["layouts"])
    assert "misses the SLO even at a trickle" in doc["layouts"][0]["why"]
    argv = ["--profile", str(tmp_path / "profile.json"), "--workload", "long-input", "--slo", "ttft:100"]
    assert cli.main([*argv, "--duration-s", "10", "--launch-flags"]) == 1
    assert "no layout meets" in capsys.readouterr().err


def test_slo_parsing() -> None:
    assert cli.parse_slo("ttft:1000,tpot:15") == {"ttft": 1000.0, "tpot": 15.0}
    assert cli.parse_slo("itl_p99:50") == {"itl_p99": 50.0}
    for bad in ("ttft", "p99:3", ""):
        with pytest.raises(ValueError):
            cli.parse_slo(bad)


def test_plan_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, pdserve.router.plan.cli; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_rate_beyond_what_the_layout_sustains_fails_however_loose_the_ttft() -> None:
    """Requests keep arriving through the scored window, so past the layout's throughput a queue builds and the
    rate fails. (A fixed count of requests arrives as one burst at a high rate: here 400 of them clear in under a
    second, within any loose TTFT, and the knee would be wherever the search stopped.)"""
    profile = Profile.from_json(profile_doc(0.001, 0.5, 1.0, 0.01))  # NOTE: a step of 128 decodes: 2.28 ms
    trace = Trace(WORKLOADS["chat"], seed=0, max_model_len=None)
    plan = PlanConfig(warmup_s=5.0, duration_s=10.0)
    result = find_goodput(colocated(2, 512), StepCost(profile), trace, {"ttft": 2000.0, "tpot": 50.0}, plan)
    throughput = 2 * plan.sim.max_num_seqs / (profile.decode_time(128, 0) / 1e3) / trace.mean_output_len
    # NOTE: past it, the queue a run of warmup + duration builds must outgrow the TTFT, as in a measured run
    ceiling = throughput * (1 + 2.0 / (plan.warmup_s + plan.duration_s))
    assert 0.5 * throughput < result.goodput <= ceiling
    assert result.over is not None and result.over.by_kind["ttft"] < plan.target


def test_a_lower_rates_requests_are_a_prefix_of_a_higher_ones() -> None:
    trace = Trace(WORKLOADS["long-input"], seed=3, max_model_len=8192)
    plan = PlanConfig(warmup_s=2.0, duration_s=4.0, min_requests=10)
    low, low_window = trace.window(5.0, plan)
    high, high_window = trace.window(5000.0, plan)  # NOTE: 30k arrivals: the stream draws more blocks
    assert len(high) > 4 * DRAW_BLOCK and len(low) == low_window.stop
    assert high_window.start == pytest.approx(10000, rel=0.03)
    assert [(r.prompt_len, r.output_len) for r in low] == [(r.prompt_len, r.output_len) for r in high[: len(low)]]
    assert [r.arrival * 5.0 for r in low] == pytest.approx([r.arrival * 5000.0 for r in high[: len(low)]])
    assert all(r.prompt_len <= max(8192 - r.output_len, 1) for r in high)
    sparse, window = trace.window(0.5, plan)  # NOTE: 2 arrivals in 4 s: the window grows to hold 10
    assert window.stop - window.start == pytest.approx(10, abs=6) and sparse[-1].arrival > 2.0 + 4.0


def test_a_handoffs_kv_copy_runs_beside_the_decode_steps_and_delays_only_its_request() -> None:
    """A decoding request's gaps stay plain steps while a later request's KV is copied in (pdserve's decode steps do
    not wait for it); the later request joins at the first step boundary after its copy (5 ms, under a step)."""
    doc = json.loads(json.dumps(DECODE_BOUND))
    doc["handoff"] = {"fixed_ms": 2.0, "ms_per_token": 0.005}  # 1000 tokens: 5 ms of copying
    gaps, joins = {}, {}
    for name, profile in (("copy", doc), ("free", DECODE_BOUND)):
        early, late = SimRequest(0.0, 1000, 40), SimRequest(0.1, 1000, 5)
        simulate(disaggregated(1, 1, 2, (50, 50)), StepCost(Profile.from_json(profile)), [early, late], SimConfig())
        assert early.step_ends is not None and late.ttft == pytest.approx(0.015)
        gaps[name] = max(np.diff(early.step_ends[early.first_step : early.first_step + early.output_len - 1]))
        joins[name] = late.first_step
    assert gaps["copy"] == gaps["free"] == pytest.approx((10 + 0.5 * 2) / 1e3)  # NOTE: a step at batch 2
    assert joins["copy"] == joins["free"] + 1


def test_handoff_copies_run_one_after_another() -> None:
    """Three requests handed off at once: their copies (12 ms each) queue on the decode GPU's one copy stream, so
    the third joins after 36 ms of copying, not 12."""
    doc = json.loads(json.dumps(DECODE_BOUND))
    doc["handoff"] = {"fixed_ms": 0.0, "ms_per_token": 0.012}  # 1000 tokens: 12 ms
    reqs = [SimRequest(0.0, 1000, 3) for _ in range(3)]
    simulate(disaggregated(1, 1, 2, (50, 50)), StepCost(Profile.from_json(doc)), reqs, SimConfig())
    first_decode = [r.step_ends[r.first_step] - r.first_token for r in reqs if r.step_ends is not None]
    assert len(first_decode) == 3 and first_decode == sorted(first_decode)
    assert first_decode[2] > 0.036 > first_decode[0]
