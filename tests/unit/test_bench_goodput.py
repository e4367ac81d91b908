"""scripts/bench_goodput.py: the table from sweep JSONs as the sweep writes them (knees, goodput per GPU, the
planner's error, the ratio of the best disaggregated to the best colocated layout, cells not run or failed); the
pairs a later call still has to run; rates that bracket the predicted knees and rates added where the measured
ones do not; lanes (goodput_lanes.py); and --smoke end to end on CPU (two layouts in two lanes, one workload, two
rates), then a call that has nothing left to run."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdserve.router.benchmark.rescore import rescore
from pdserve.router.benchmark.sweep import find_knee, summary
from pdserve.router.plan.layouts import layouts_for
from pdserve.router.plan.profile import Profile
from tests.child_env import child_env
from tests.unit.test_plan_model import profile_doc

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_goodput.py"
LOOSE = {"ttft": 2000.0, "tpot": 50.0}
LOOSE_TAG = "ttft2000-tpot50"


sys.path.insert(0, str(SCRIPT.parent))
goodput_table = importlib.import_module("goodput_table")
sys.path.remove(str(SCRIPT.parent))


@pytest.fixture(scope="module")
def script() -> Any:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(SCRIPT.parent))  # NOTE: it imports bench_serving_suite and bench_tp_serving
        return importlib.import_module("bench_goodput")


def rate_row(rate: float, attainment: float, gpus: int = 2) -> dict[str, Any]:
    """A rate's figures as sweep.rate_result gives them (only what summary() reads)."""
    metrics = {"request_throughput": rate, "output_throughput": 200 * rate, "p90_ttft_ms": 100.0, "p90_tpot_ms": 9.0}
    return {"request_rate": rate, "num_requests": 100, "slo_attainment": attainment, "goodput": rate * attainment,
            "goodput_per_gpu": rate * attainment / gpus, "slo_attainment_by_kind": {"ttft": attainment},
            "metrics": metrics}  # fmt: skip


def write_pair(out: Path, layout: str, workload: str, attainment: dict[float, float], complete: bool = True) -> None:
    """A pair's summary and its summary rescored under LOOSE, as the script leaves them."""
    folder = out / "sweeps" / layout.replace(":", "_")
    folder.mkdir(parents=True, exist_ok=True)
    runs = [rate_row(rate, a) for rate, a in attainment.items()]
    header = {"gpu": "NVIDIA H100 80GB HBM3", "commands": [f"bench {layout} {workload}"], "complete": complete}
    doc = {"config": {}, "sweep": summary(runs, LOOSE, 2, layout, 0.9), "runs": runs, "bench_goodput": header}
    (folder / f"{workload}.json").write_text(json.dumps(doc))
    (folder / f"{workload}.{LOOSE_TAG}.json").write_text(json.dumps(doc))


def plan(per_gpu: dict[str, float], recommended: str) -> dict[str, Any]:
    """pdserve-plan --json's fields the table reads."""
    rows = [{"layout": name, "goodput": 2 * g, "goodput_per_gpu": g} for name, g in per_gpu.items()]
    lengths = {"mean_input_len": 211.0, "mean_output_len": 212.0, "max_model_len": 8192}
    return {"layouts": rows, "recommended": recommended, "workload": lengths, "command": "pdserve-plan ..."}


PREDICTED = {"colocated-c512": 2.5, "colocated-c2048": 1.5, "1P:1D": 2.0, "1P:2D-shared": 1.0, "2P:1D-shared": 0.8}


def test_table_from_sweeps_has_knees_errors_the_ratio_and_cells_not_run(script: Any, tmp_path: Path) -> None:
    write_pair(tmp_path, "colocated-c512", "chat", {2.0: 1.0, 4.0: 0.95, 6.0: 0.5})  # knee 4 + 0.05/0.45 * 2
    write_pair(tmp_path, "colocated-c2048", "chat", {1.0: 0.5, 2.0: 0.2})  # no rate meets it
    write_pair(tmp_path, "1P:1D", "chat", {4.0: 0.98, 6.0: 0.92, 8.0: 0.4})  # knee 6 + 0.02/0.52 * 2
    write_pair(tmp_path, "2P:1D-shared", "chat", {1.0: 1.0, 2.0: 0.95})  # the highest rate still meets it
    (tmp_path / "sweeps" / "1P_2D-shared").mkdir(parents=True)
    (tmp_path / "sweeps" / "1P_2D-shared" / "error.json").write_text(json.dumps({"error": "PartFailed: OOM"}))
    plans = {w: {LOOSE_TAG: plan(PREDICTED, "colocated-c512")} for w in ("chat", "long-input")}
    header = {"num_gpus": 2, "profile": "p.json", "profile_gpu": "H100", "settings": {"warmup_s": 10, "duration_s": 20},
              "gpu": "unknown", "date": "d", "command": "python3 scripts/bench_goodput.py --report"}  # fmt: skip
    table = script.build_table(tmp_path, layouts_for(2), plans, {LOOSE_TAG: LOOSE}, header)
    chat, long_input = table["tables"]
    rows = {r["layout"]: r for r in chat["rows"]}
    c512, c2048, disagg = rows["colocated-c512"], rows["colocated-c2048"], rows["1P:1D"]
    assert c512["bound"] == "=" and c512["knee_rate"] == 4.0
    assert c512["goodput_per_gpu"] == pytest.approx((4 + 2 / 9) / 2)
    assert c512["prediction_error"] == pytest.approx((2.5 - (4 + 2 / 9) / 2) / ((4 + 2 / 9) / 2))
    assert disagg["goodput_per_gpu"] == pytest.approx((6 + 2 * 0.02 / 0.52) / 2)
    assert disagg["prediction_error"] == pytest.approx(2.0 / disagg["goodput_per_gpu"] - 1)
    assert c2048["bound"] == "<" and c2048["goodput_per_gpu"] == 0.5 and c2048["prediction_error"] is None
    shared = rows["2P:1D-shared"]
    assert shared["bound"] == ">=" and shared["goodput_per_gpu"] == 1.0 and shared["prediction_error"] is None
    assert rows["1P:2D-shared"]["status"] == "failed: PartFailed: OOM" and "bound" not in rows["1P:2D-shared"]
    ratio = pytest.approx(disagg["goodput_per_gpu"] / c512["goodput_per_gpu"])
    assert chat["measured"] == {"best_colocated": "colocated-c512", "best_disaggregated": "1P:1D", "ratio": ratio}
    assert chat["predicted"] == {"best_colocated": "colocated-c512", "best_disaggregated": "1P:1D", "ratio": 0.8}
    assert chat["recommended"] == "colocated-c512" and chat["measured_best"] == "1P:1D"
    assert chat["recommended_predicted_per_gpu"] == 2.5
    assert [r["status"] for r in long_input["rows"]] == ["not run"] * 3 + ["failed: PartFailed: OOM", "not run"]
    assert long_input["measured"] == {"best_colocated": None, "best_disaggregated": None, "ratio": None}
    assert table["complete"] is False and table["measured_on"] == ["NVIDIA H100 80GB HBM3"]
    assert "bench 1P:1D chat" in table["commands"] and "pdserve-plan ..." in table["commands"]
    plots = script.write_plots(tmp_path, layouts_for(2), table)  # long-input has no sweep: no plot
    assert [p.relative_to(tmp_path).as_posix() for p in plots] == [
        f"plots/chat.{LOOSE_TAG}/attainment_vs_rate.png",
        f"plots/chat.{LOOSE_TAG}/goodput_per_gpu_vs_rate.png",
    ]
    assert all(p.stat().st_size > 1000 for p in plots)
    md = script.table_md(table)
    assert "| colocated-c512 | 2.11 | 4 | 2.5 | +18% | 2: 100%, 4: 95%, 6: 50% |" in md
    assert "| colocated-c2048 | < 0.5 | - | 1.5 | - |" in md and "| 2P:1D-shared | >= 1 | 2 | 0.8 | - |" in md
    assert "| 1P:1D | not run | | 2 | | |" in md and "measured 1P:1D / colocated-c512 = 1.44" in md


def test_a_later_call_skips_done_pairs_and_tries_failed_layouts_last(script: Any, tmp_path: Path) -> None:
    write_pair(tmp_path, "1P:1D", "chat", {1.0: 1.0, 2.0: 0.5})
    write_pair(tmp_path, "1P:1D", "long-input", {1.0: 1.0}, complete=False)  # stopped before its last rate
    (tmp_path / "sweeps" / "colocated-c512").mkdir(parents=True)
    (tmp_path / "sweeps" / "colocated-c512" / "error.json").write_text(json.dumps({"error": "PartFailed: x"}))
    pairs = script.remaining_pairs(tmp_path, ["colocated-c512", "1P:1D", "2P:1D-shared"], ["chat", "long-input"])
    assert pairs == [("1P:1D", "long-input"), ("2P:1D-shared", "chat"), ("2P:1D-shared", "long-input"),
                     ("colocated-c512", "chat"), ("colocated-c512", "long-input")]  # fmt: skip
    folder = tmp_path / "sweeps" / "1P_1D"
    (folder / "long-input.rate-1.json").write_text(json.dumps({"request_rate": 1.0, "requests": []}))
    (folder / "long-input.rate-2.json").write_text('{"request_rate": 2.0, "requ')  # cut off mid-write
    assert list(goodput_table.measured_rates(tmp_path, "1P:1D", "long-input")) == [1.0]


def test_rates_of_an_earlier_call_without_their_json_are_kept_as_scored(script: Any, tmp_path: Path) -> None:
    """--out as committed (no rate JSONs): the summary's rates count as measured and each SLO's scored runs are
    kept; a rate measured now joins them; a rate with neither its JSON nor a scored run is an error."""
    write_pair(tmp_path, "1P:1D", "chat", {2.0: 1.0, 4.0: 0.5})
    assert goodput_table.scored_rates(tmp_path, "1P:1D", "chat") == {2.0, 4.0}
    kept = goodput_table.kept_runs(tmp_path, "1P:1D", "chat", LOOSE_TAG)
    assert sorted(kept) == [2.0, 4.0] and kept[4.0]["slo_attainment"] == 0.5
    folder = tmp_path / "sweeps" / "1P_1D"
    summary_doc = json.loads((folder / "chat.json").read_text()) | {"config": {"sweep": {"warmup": 1, "duration": 2}}}
    (folder / "chat.json").write_text(json.dumps(summary_doc))
    (folder / "chat.rate-4.json").write_text(json.dumps({"request_rate": 4.0, "requests": []}))
    assert sorted(goodput_table.kept_runs(tmp_path, "1P:1D", "chat", LOOSE_TAG)) == [2.0]  # 4's JSON is here
    (folder / "chat.rate-4.json").unlink()
    layout = next(x for x in layouts_for(2) if x.name == "1P:1D")
    merged = goodput_table.merge_rates(tmp_path, layout, "chat", LOOSE, kept)
    assert merged["config"] == summary_doc["config"]
    assert [r["request_rate"] for r in merged["sweep"]["rates"]] == [2.0, 4.0]
    assert merged["sweep"]["knee"]["rate"] == 2.0
    (folder / "chat.json").write_text(json.dumps(merged))
    again = rescore(folder / "chat.json", LOOSE, kept)
    assert again["runs"] == [kept[2.0], kept[4.0]]
    with pytest.raises(ValueError, match="neither its JSON"):
        rescore(folder / "chat.json", LOOSE, {2.0: kept[2.0]})


def test_rates_bracket_every_predicted_knee_at_most_the_step_apart(script: Any) -> None:
    gpu = script.GPU
    assert script.choose_rates([10.0], gpu) == [7.0, 9.54, 13.0]
    rates = script.choose_rates([4.0, 6.0, 10.0], gpu)
    assert rates[0] <= 0.7 * 4.0 and rates[-1] >= 1.3 * 10.0 and len(rates) == 5
    assert all(b / a <= script.RATE_STEP * 1.01 for a, b in zip(rates, rates[1:], strict=False))
    wide = script.choose_rates([2.0, 40.0], gpu)
    assert len(wide) == 5 and wide[0] == 1.4 and wide[-1] == 52.0  # at most 5 rates: farther apart
    assert script.choose_rates([0.5], gpu)[0] == 1.0  # 20 requests in the 20 s window at least
    assert script.choose_rates([10.0], script.SMOKE) == [7.0, 13.0]
    plans = {"a": plan({"1P:1D": 0.0, "colocated-c512": 5.0}, "colocated-c512")}
    assert script.pair_rates(plans, "1P:1D", gpu) == script.choose_rates([10.0], gpu)  # the best layout's knee


def sweep(attainment: dict[float, float]) -> dict[str, Any]:
    return summary([rate_row(r, a) for r, a in attainment.items()], LOOSE, 2, "1P:1D", 0.9)


def test_a_rate_is_added_above_a_top_rate_that_attains_or_below_a_bottom_one_that_misses(script: Any) -> None:
    gpu, planned = script.GPU, [2.0, 4.0]
    tight, loose = sweep({2.0: 0.95, 4.0: 0.5}), sweep({2.0: 1.0, 4.0: 0.92})
    assert script.extra_rate([loose, tight], [5.0, 3.0], planned, gpu) == 6.4
    missed = sweep({2.0: 0.6, 4.0: 0.1})
    assert script.extra_rate([tight, missed], [3.0, 1.0], planned, gpu) == 1.25
    # no knee predicted under `missed`: none sought below; tight's knee, between 2 and 4, gets their middle
    assert script.extra_rate([tight, missed], [3.0, 0.0], planned, gpu) == 2.83
    narrow = sweep({2.0: 0.95, 2.5: 0.5})
    assert script.extra_rate([narrow], [3.0], [2.0, 2.5], gpu) is None  # bracketed within 1.3x
    all_extra = sweep({2.0: 1.0, 4.0: 1.0, 6.4: 1.0, 10.2: 1.0, 16.4: 1.0, 26.2: 1.0})
    assert gpu.max_extra_rates == 4 and script.extra_rate([all_extra], [3.0], planned, gpu) is None


def test_the_widest_knee_bracket_is_narrowed_first(script: Any) -> None:
    loose, tight = sweep({2.0: 1.0, 4.0: 1.0, 10.0: 0.4}), sweep({2.0: 1.0, 4.0: 0.5, 10.0: 0.1})
    assert script.narrow_rate([tight, loose], [2.0, 4.0, 10.0]) == 6.32  # [4, 10] is wider than [2, 4]
    assert script.narrow_rate([tight], [2.0, 4.0, 10.0]) == 2.83
    assert script.narrow_rate([sweep({2.0: 0.5, 4.0: 0.1})], [2.0, 4.0]) is None  # no rate met it: no bracket
    assert script.narrow_rate([sweep({2.0: 1.0, 2.5: 0.2})], [2.0, 2.5]) is None  # within BRACKET_RATIO


def test_shared_layouts_get_the_planners_pool_of_their_shared_decode_worker(script: Any) -> None:
    profile = Profile.from_json(profile_doc(0.5, 20, 20, 1.0, gpus=2) | {"kv_capacity_tokens": 256000})
    by_name = {layout.name: layout for layout in layouts_for(2)}
    assert script.shared_pool_blocks(profile, by_name["2P:1D-shared"]) == 8000
    assert script.shared_pool_blocks(profile, by_name["1P:1D"]) is None


def run_smoke(out: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(SCRIPT), "--smoke", "--profile", str(profile), "--out", str(out), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=child_env())


def smoke_profile(tmp_path: Path) -> Path:
    """A CPU profile whose predicted knees for chat are a few req/s under the loosest SLO."""
    doc = profile_doc(0.5, 20, 20, 1.0, gpus=2) | {"gpu": "cpu", "model": {"shape": "llama-8b", "max_model_len": 512}}
    (tmp_path / "profile.json").write_text(json.dumps(doc))
    return tmp_path / "profile.json"


def test_with_too_little_time_before_the_deadline_nothing_starts_and_it_exits_1(tmp_path: Path) -> None:
    proc = run_smoke(tmp_path / "out", smoke_profile(tmp_path), "--deadline-s", "40")  # 10 s past the reserve
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "== colocated-c512's cluster needs 59 s: left for a later call" in proc.stdout
    assert "cluster_cli" not in proc.stdout
    table = json.loads((tmp_path / "out" / "table.json").read_text())
    assert table["complete"] is False and all(r["status"] == "not run" for t in table["tables"] for r in t["rows"])


@pytest.mark.slow
def test_smoke_measures_two_layouts_in_two_lanes_on_cpu_and_a_second_call_has_nothing_left(tmp_path: Path) -> None:
    profile, out = smoke_profile(tmp_path), tmp_path / "out"
    proc = run_smoke(out, profile, "--lanes", "2")  # NOTE: one layout a lane, on stand-in GPUs cpu-0,1 and cpu-2,3
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lanes = sorted((out / "logs").glob("lane-*.log"))
    assert [p.name for p in lanes] == ["lane-0.log", "lane-1.log"]
    assert "--lane-gpus cpu-0,cpu-1" in proc.stdout and "--lane-gpus cpu-2,cpu-3" in proc.stdout
    table = json.loads((out / "table.json").read_text())
    assert table["complete"] is True and table["gpu"] == "cpu" and table["measured_on"] == ["cpu"]
    slos = ["ttft2000-tpot50", "ttft1500-tpot25", "ttft1000-tpot15", "ttft1000-itl_p99_10"]
    assert [t["slo"] for t in table["tables"]] == slos
    for t in table["tables"]:
        assert [r["layout"] for r in t["rows"]] == ["colocated-c512", "1P:1D"]
        for row in t["rows"]:
            rescored = json.loads(
                (out / "sweeps" / row["layout"].replace(":", "_") / f"chat.{t['slo']}.json").read_text()
            )
            assert [rate for rate, _ in row["rates"]] == [r["request_rate"] for r in rescored["sweep"]["rates"]]
            assert len(row["rates"]) == 2 and rescored["sweep"]["slos_ms"] == t["slos_ms"]
            assert row["knee_rate"] == find_knee(rescored["runs"])._asdict()["rate"] and row["status"] == "done"
            assert rescored["bench_goodput"]["gpu"] == "cpu"
        assert sorted(p.name for p in (out / "plots" / f"chat.{t['slo']}").iterdir()) == [
            "attainment_vs_rate.png",
            "goodput_per_gpu_vs_rate.png",
        ]
    commands = "\n".join(table["commands"])
    assert commands.count("pdserve.router.cluster_cli") == 2 and "--device cpu" in commands
    assert "--decode-gpus cpu-0,cpu-1" in commands and "--prefill-gpus cpu-2 --decode-gpus cpu-3" in commands
    assert commands.count("--dataset chat --request-rate") == 4 and "--save-detailed" in commands
    run = json.loads((out / "run.json").read_text())
    assert run["invocations"][0]["env"]["NCCL_NVLS_ENABLE"] == "0" and run["invocations"][0]["lanes"] == 2
    again = run_smoke(out, profile)
    assert again.returncode == 0 and "pdserve.router.cluster_cli" not in again.stdout.split("## Commands")[0]
    assert len(json.loads((out / "run.json").read_text())["invocations"]) == 2
    assert json.loads((out / "table.json").read_text())["tables"] == table["tables"]


def test_lanes_split_layouts_by_planned_seconds_and_name_their_gpus(script: Any) -> None:
    lanes = script.goodput_lanes
    seconds = {"colocated-c512": 500.0, "1P:1D": 400.0, "1P:2D-shared": 300.0, "2P:1D-shared": 250.0}
    assert lanes.split(seconds, 2) == [["colocated-c512", "2P:1D-shared"], ["1P:1D", "1P:2D-shared"]]
    assert lanes.split({"1P:1D": 1.0}, 2) == [["1P:1D"]]
    assert lanes.lane_gpus(["a", "b", "c", "d"], 2, 2) == [["a", "b"], ["c", "d"]]
    with pytest.raises(ValueError, match="needs 4, the host has 3"):
        lanes.lane_gpus(["a", "b", "c"], 2, 2)
    flags = [
        "--max-num-seqs",
        "8",
        "--prefill",
        "2",
        "--prefill-gpus",
        "0,1",
        "--decode-gpus",
        "1",
        "--mps-split",
        "50/50",
    ]
    assert lanes.lane_flags(flags, ["u2", "u3"]) == [*flags[:5], "u2,u3", "--decode-gpus", "u3", *flags[-2:]]
    argv = ["--profile", "p.json", "--lanes", "2", "--layouts=1P:1D", "--deadline-s", "500", "--out", "o"]
    child = lanes.child_argv("bench_goodput.py", argv, ["1P:1D"], ["u0", "u1"], 480.4)
    assert child[1:] == ["bench_goodput.py", "--profile", "p.json", "--out", "o", "--layouts", "1P:1D",
                         "--lane-gpus", "u0,u1", "--deadline-s", "480"]  # fmt: skip


def test_report_writes_the_planned_table_without_a_gpu(tmp_path: Path) -> None:
    profile, out = smoke_profile(tmp_path), tmp_path / "out"
    argv = [sys.executable, str(SCRIPT), "--profile", str(profile), "--gpus", "2", "--out", str(out), "--report"]
    proc = subprocess.run([*argv, "--workloads", "chat"], capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 1, proc.stderr[-4000:]  # NOTE: nothing measured: the table is incomplete
    table = json.loads((out / "table.json").read_text())
    assert table["complete"] is False and len(table["tables"]) == 4
    assert all(
        r["status"] == "not run" and r["predicted_goodput_per_gpu"] >= 0 for t in table["tables"] for r in t["rows"]
    )
    assert sorted(p.name for p in (out / "plans").iterdir())[-1] == "chat.ttft2000-tpot50.json"


def test_several_front_ends_share_a_fixed_port_and_one_keeps_the_tables_settings(script: Any, tmp_path: Path) -> None:
    profile = Profile.from_json(profile_doc(0.5, 20, 20, 1.0, gpus=2))
    layout = next(x for x in layouts_for(2) if x.name == "1P:1D")

    def argv(frontends: int) -> list[str]:
        ctx = script.Context(script.SMOKE, tmp_path, profile, tmp_path / "model", tmp_path, script.Deadline(600.0), {},
                             {}, {}, (), frontends)  # fmt: skip
        return list(script.cluster_argv(ctx, layout, tmp_path / "run"))

    one, four = argv(1), argv(4)
    assert one[one.index("--port") + 1] == "0" and "--frontends" not in one
    assert int(four[four.index("--port") + 1]) > 0 and four[four.index("--frontends") + 1] == "4"
    args = script.parse_args(["--profile", "p", "--out", "o"])
    settings = script.call_settings(args, script.GPU, 2, {})
    assert "frontends" not in settings  # NOTE: tables measured before the flag existed go on
    args.frontends = 4
    assert script.call_settings(args, script.GPU, 2, {}) == settings | {"frontends": 4}
