"""The planner with tensor-parallel workers: a profile's "tp" section, the TP layouts of a GPU count and the
pdserve-cluster flags that start them, each worker simulated at its TP size's costs, and TP layouts recommended
only where their profiled steps earn the GPUs they take."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.router import cluster_cli
from pdserve.router.placement import compute_gpus, gpu_lists
from pdserve.router.plan import cli
from pdserve.router.plan.layouts import Layout, disaggregated, layouts_for
from pdserve.router.plan.profile import Profile
from pdserve.router.plan.simulate import SimConfig, SimRequest, StepCost, simulate
from tests.unit.test_plan_model import profile_doc


def with_tp2(base: dict[str, Any], tp2: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """base (TP 1) with tp2's prefill and decode points as its TP-2 entry."""
    return base | {"tp": {"2": {"prefill": tp2["prefill"], "decode": tp2["decode"], **extra}}}


BASE = profile_doc(0.01, 2.0, 12.0, 0.5, gpus=4)
"""TP 1: cheap prompts, a decode step of 12 + 0.5 ms per sequence: 6 sequences fit a 15 ms TPOT."""
FAST_TP2 = with_tp2(BASE, profile_doc(0.005, 1.0, 4.0, 0.05))
"""TP 2 runs a decode step in 4 + 0.05 ms per sequence: a full batch (32) fits a 15 ms TPOT."""
NO_GAIN_TP2 = with_tp2(BASE, BASE)
"""TP 2 steps take as long as TP 1's: a TP-2 worker is a TP-1 worker on two GPUs."""


def test_profile_round_trips_its_tp_section_and_names_a_missing_size() -> None:
    doc = with_tp2(BASE | {"kv_capacity_tokens": 1000, "mps_slowdown": {"decode": {"50": 1.5}}},
                   profile_doc(0.005, 1.0, 4.0, 0.05), kv_capacity_tokens=3000)  # fmt: skip
    profile = Profile.from_json(doc)
    assert Profile.from_json(profile.to_json()) == profile and profile.tp_sizes == (1, 2)
    tp2 = profile.at_tp(2)
    assert (tp2.tp_size, tp2.kv_capacity_tokens, profile.at_tp(1).kv_capacity_tokens) == (2, 3000, 1000)
    assert tp2.decode_time(10, 500) == pytest.approx(4.5) and profile.decode_time(10, 500) == pytest.approx(17.0)
    assert tp2.prefill_time(1000) == pytest.approx(6.0) and tp2.handoff_time(100) == profile.handoff_time(100)
    assert tp2.slowdown("decode", 0.5) == 1.5 and tp2.by_tp == {}
    assert Profile.from_json(BASE).tp_sizes == (1,) and "tp" not in Profile.from_json(BASE).to_json()
    with pytest.raises(ValueError, match="no costs at TP 4 .*TP 1, 2.*--tp 4"):
        profile.at_tp(4)
    with pytest.raises(ValueError, match=r"no costs at TP 1 \(it has TP 2\)"):
        tp2.at_tp(1)  # NOTE: a TP-2 entry holds no other sizes
    for bad in ({"1": doc["tp"]["2"]}, {"2": {"prefill": BASE["prefill"]}}):
        with pytest.raises(ValueError, match='"tp" entry'):
            Profile.from_json(BASE | {"tp": bad})


def groups_of(layout: Layout) -> dict[str, list[str]]:
    """Each worker's GPUs as pdserve-cluster places them (names as compute_gpus gives them)."""
    return {
        **{f"prefill-{i}": [str(g) for g in w.gpus] for i, w in enumerate(layout.prefill)},
        **{f"decode-{j}": [str(g) for g in w.gpus] for j, w in enumerate(layout.decode)},
    }


def test_layouts_of_four_gpus_with_tp_2_and_their_cluster_flags(tiny_llama_dir: Path) -> None:
    layouts = {layout.name: layout for layout in layouts_for(4, tp_sizes=(1, 2))}
    one_gpu = [layout.name for layout in layouts_for(4)]
    assert list(layouts) == [*one_gpu, "colocated-tp2-c512", "colocated-tp2-c2048", "2P:1D(tp2)", "1P(tp2):2D",
                             "1P(tp2):1D(tp2)"]  # fmt: skip
    flags = {name: layouts[name].cluster_flags(64)[2:] for name in list(layouts)[len(one_gpu) :]}
    assert flags == {
        "colocated-tp2-c512": ["--colocated", "--decode", "2", "--decode-gpus", "0,1,2,3", "--tp", "2",
                               "--max-num-batched-tokens", "512", "--prefill-chunk-size", "512"],
        "colocated-tp2-c2048": ["--colocated", "--decode", "2", "--decode-gpus", "0,1,2,3", "--tp", "2",
                                "--max-num-batched-tokens", "2048", "--prefill-chunk-size", "2048"],
        "2P:1D(tp2)": ["--prefill", "2", "--decode", "1", "--prefill-gpus", "0,1", "--decode-gpus", "2,3",
                       "--prefill-tp", "1", "--decode-tp", "2"],
        "1P(tp2):2D": ["--prefill", "1", "--decode", "2", "--prefill-gpus", "0,1", "--decode-gpus", "2,3",
                       "--prefill-tp", "2", "--decode-tp", "1"],
        "1P(tp2):1D(tp2)": ["--prefill", "1", "--decode", "1", "--prefill-gpus", "0,1", "--decode-gpus", "2,3",
                            "--prefill-tp", "2", "--decode-tp", "2"],
    }  # fmt: skip
    for layout in layouts.values():  # NOTE: pdserve-cluster places every worker on the groups the planner modelled
        argv = ["--model", str(tiny_llama_dir), "--device", "cuda", *layout.cluster_flags(64)]
        args, _ = cluster_cli.parse_args(cluster_cli.build_parser(), argv)
        placed = compute_gpus(gpu_lists(args.prefill_gpus), gpu_lists(args.decode_gpus), args.prefill, args.decode,
                              args.prefill_tp, args.decode_tp)  # fmt: skip
        assert placed == groups_of(layout), layout.name


@pytest.mark.parametrize("num_gpus", [1, 2, 3, 4, 6, 8])
def test_every_layout_uses_exactly_the_gpus_given(num_gpus: int) -> None:
    for layout in layouts_for(num_gpus, tp_sizes=(1, 2, 4)):
        workers = [*layout.prefill, *layout.decode]
        used = [g for w in workers for g in w.gpus]
        shared = [w for w in workers if w.sm_share < 1]
        assert set(used) == set(range(num_gpus)), layout.name
        if layout.mps_split is None:
            assert sorted(used) == list(range(num_gpus)) and not shared, layout.name
        else:  # NOTE: exactly the two workers on the shared group split it
            assert len(shared) == 2 and shared[0].gpus == shared[1].gpus, layout.name
            assert len(used) == num_gpus + len(shared[0].gpus), layout.name


def test_tp_layouts_of_two_gpus_include_the_whole_host_shared_under_mps() -> None:
    names = [layout.name for layout in layouts_for(2, tp_sizes=(1, 2))][5:]
    assert names == ["colocated-tp2-c512", "colocated-tp2-c2048", "1P(tp2):1D(tp2)-shared"]
    shared = layouts_for(2, mps_split=(60, 40), tp_sizes=(2,))[-1]
    assert shared.cluster_flags(8)[2:] == ["--prefill", "1", "--decode", "1", "--prefill-gpus", "0,1",
                                           "--decode-gpus", "0,1", "--prefill-tp", "2", "--decode-tp", "2",
                                           "--mps-split", "60/40"]  # fmt: skip
    assert (shared.prefill[0].sm_share, shared.decode[0].sm_share, shared.decode[0].kv_share) == (0.6, 0.4, 0.5)
    assert [layout.name for layout in layouts_for(3, tp_sizes=(1, 2))][-2:] == ["1P:1D(tp2)", "1P(tp2):1D"]
    assert len(layouts_for(1, tp_sizes=(1, 2))) == len(layouts_for(1))
    with pytest.raises(ValueError, match=r"1P\(tp2\):1D does not fit 4 GPUs"):
        disaggregated(1, 1, 4, (50, 50), 2, 1)  # a GPU left over
    with pytest.raises(ValueError, match=r"1P\(tp2\):2D does not fit 2 GPUs"):
        disaggregated(1, 2, 2, (50, 50), 2, 1)  # NOTE: groups of different TP sizes cannot share GPUs


def test_each_worker_steps_at_its_tp_sizes_costs() -> None:
    cost = StepCost(Profile.from_json(FAST_TP2))
    layout = disaggregated(1, 1, 3, (50, 50), 2, 1)
    req = simulate(layout, cost, [SimRequest(0.0, 1000, 5)], SimConfig())[0]
    assert req.first_token == pytest.approx((1 + 0.005 * 1000) / 1e3)  # the TP-2 prefill
    assert req.done == pytest.approx(req.first_token + (2 + 4 * (12 + 0.5)) / 1e3)  # handoff, TP-1 decode steps
    req = simulate(disaggregated(1, 1, 3, (50, 50), 1, 2), cost, [SimRequest(0.0, 1000, 5)], SimConfig())[0]
    assert req.first_token == pytest.approx((2 + 0.01 * 1000) / 1e3)
    assert req.done == pytest.approx(req.first_token + (2 + 4 * (4 + 0.05)) / 1e3)


def test_a_decode_worker_holds_its_tp_sizes_kv_capacity() -> None:
    doc = with_tp2(BASE | {"kv_capacity_tokens": 1500}, BASE, kv_capacity_tokens=4000)
    cost = StepCost(Profile.from_json(doc))

    def gap(decode_tp: int) -> float:
        reqs = [SimRequest(0.0, 1000, 3), SimRequest(0.0, 1000, 3)]
        done = simulate(disaggregated(1, 1, 1 + decode_tp, (50, 50), 1, decode_tp), cost, reqs, SimConfig())
        return done[1].done - done[0].done

    assert gap(1) == pytest.approx(2 * 0.0125, rel=0.05)  # NOTE: the second waits for the first's KV
    assert gap(2) < 0.005  # both fit TP 2's pool: they decode side by side


def plan_doc(doc: dict[str, Any], tmp_path: Path, *extra: str) -> dict[str, Any]:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    return cli.plan(cli.build_parser().parse_args([*plan_argv(path), *extra]))


def plan_argv(path: Path) -> list[str]:
    return ["--profile", str(path), "--workload", "chat", "--slo", "ttft:500,tpot:15", "--max-num-seqs", "32",
            "--duration-s", "10"]  # fmt: skip


def test_faster_tp_2_steps_win_a_tight_tpot_slo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_doc(FAST_TP2, tmp_path)
    assert doc["profile"]["tp_sizes"] == [1, 2] and len(doc["layouts"]) == 14
    rows = {r["layout"]: r for r in doc["layouts"]}
    assert "tp2" in doc["recommended"] and rows[doc["recommended"]]["tp"]["decode"] == 2
    best_tp1 = max(r["goodput_per_gpu"] for r in doc["layouts"] if "tp" not in r["layout"])
    assert rows[doc["recommended"]]["goodput_per_gpu"] > 1.3 * best_tp1
    assert cli.main([*plan_argv(tmp_path / "profile.json"), "--launch-flags"]) == 0
    flags = capsys.readouterr().out.split()
    tp_flag = "--tp" if "--colocated" in flags else "--decode-tp"
    assert flags == doc["cluster_flags"] and flags[flags.index(tp_flag) + 1] == "2"


def test_tp_2_steps_no_faster_than_tp_1_are_not_recommended(tmp_path: Path) -> None:
    doc = plan_doc(NO_GAIN_TP2, tmp_path)
    rows = {r["layout"]: r for r in doc["layouts"]}
    assert "tp" not in doc["recommended"] and len(rows) == 14
    assert rows["colocated-tp2-c512"]["goodput_per_gpu"] < 0.7 * rows[doc["recommended"]]["goodput_per_gpu"]
