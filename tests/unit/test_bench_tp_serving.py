"""scripts/bench_tp_serving.py: the weight bytes behind its HBM floor are transformers' Qwen2 / Llama parameter
count; the 4-GPU layout puts each role's group on its own GPUs; greedy runs compare as vLLM compares bf16 runs;
--smoke runs the GPU figure's whole flow on CPU (TP 2 groups over gloo, disaggregated then colocated) and writes
every figure with its commands; past --deadline-s it stops its cluster, writes what it has and exits 1."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdserve.router.benchmark.datasets import poisson_times
from tests.child_env import child_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_tp_serving.py"
QWEN25_32B_PARAMS = 32_763_876_352
"""Qwen2ForCausalLM(Qwen2.5-32B's config), counted by transformers."""
LLAMA3_70B_PARAMS = 70_553_706_496
"""LlamaForCausalLM(Llama-3-70B's config), counted by transformers."""
SMOKE_LONG_PROMPTS = len(poisson_times(np.random.default_rng(0), 2.0, 4.0))
"""Long prompts of the smoke's interference load (--long-rate 2, --duration 4, seed 0)."""


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=child_env())


def transformers_params(config: dict[str, Any]) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **spec))
    return sum(int(p.numel()) for p in model.parameters())


@pytest.mark.parametrize(
    ("args", "params"),
    [(["--shape", "qwen2.5-32b"], QWEN25_32B_PARAMS), (["--gpus", "4", "--shape", "llama-70b"], LLAMA3_70B_PARAMS),
     (["--smoke"], None)],
    ids=["qwen2.5-32b", "llama-70b", "tiny"],
)  # fmt: skip
def test_weight_bytes_per_gpu_are_half_of_transformers_parameters(args: list[str], params: int | None) -> None:
    proc = run_script("--part", "model", *args, timeout=120)
    assert proc.returncode == 0, proc.stderr
    model = json.loads(proc.stdout)
    assert model["num_params"] == transformers_params(model["config"])
    assert model["tp"] == 2 and model["dtype"] == ("float32" if params is None else "bfloat16")
    assert model["weight_bytes_per_gpu"] == model["num_params"] * (4 if params is None else 2) // 2
    assert params is None or model["num_params"] == params


@pytest.fixture(scope="module")
def script() -> Any:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module("bench_tp_serving")
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_on_four_gpus_each_role_has_its_own_pair_and_the_reference_is_one_group_of_four(script: Any) -> None:
    setup = script.gpu_setup(4, "llama-70b")
    assert setup.parts == ["disagg", "colocated", "whole"] and setup.model["num_hidden_layers"] == 80
    disagg = " ".join(script.cluster_flags(setup, "disagg"))
    assert "--prefill-tp 2 --decode-tp 2 --prefill-gpus 0,1 --decode-gpus 2,3" in disagg
    assert "--colocated --max-num-batched-tokens 2048" in " ".join(script.cluster_flags(setup, "colocated"))
    assert " ".join(script.cluster_flags(setup, "colocated")).endswith("--decode 2 --tp 2 --decode-gpus 0,1,2,3")
    assert " ".join(script.cluster_flags(setup, "whole")).endswith("--decode 1 --tp 4 --decode-gpus 0,1,2,3")
    two = script.gpu_setup(2, "qwen2.5-32b")
    assert two.parts == ["disagg", "colocated"]
    assert "--prefill-gpus 0,1 --decode-gpus 0,1" in " ".join(script.cluster_flags(two, "disagg"))
    assert " ".join(script.cluster_flags(two, "colocated")).endswith("--decode 1 --tp 2 --decode-gpus 0,1")


def greedy(tokens: list[int], logprobs: list[float], top: list[list[int]]) -> dict[str, Any]:
    return {"token_ids": tokens, "logprobs": logprobs, "top": [[[t, -1.0] for t in ids] for ids in top]}


def test_greedy_runs_compare_equal_up_to_a_near_tie_and_within_the_logprob_tolerance(script: Any) -> None:
    ref = [greedy([5, 6, 7], [-1.0, -2.0, -3.0], [[5, 9], [6, 8], [7, 8]])]
    assert script.compare_greedy(ref, ref)["identical"] is True
    near_tie = [greedy([5, 6, 8], [-1.02, -2.0, -3.0], [[5, 9], [6, 8], [8, 7]])]
    row = script.compare_greedy(near_tie, ref)
    assert row["identical"] is False and row["within_tolerance"] is True
    assert row["prompts"][0]["equal_tokens"] == 2 and row["prompts"][0]["max_logprob_diff"] == pytest.approx(0.02)
    not_in_top = [greedy([5, 6, 4], [-1.0, -2.0, -3.0], [[5, 9], [6, 8], [4, 2]])]
    assert script.compare_greedy(not_in_top, ref)["within_tolerance"] is False
    drifted = [greedy([5, 6, 7], [-1.0, -2.5, -3.0], [[5, 9], [6, 8], [7, 1]])]
    assert script.compare_greedy(drifted, ref)["within_tolerance"] is False
    results = {"disagg": {"greedy": ref}, "colocated": {"greedy": drifted}, "whole": {"greedy": ref}}
    versus = script.greedy_vs_reference(results)
    assert versus["reference"] == "whole" and set(versus) == {"reference", "disagg", "colocated"}
    assert versus["disagg"]["identical"] and not versus["colocated"]["within_tolerance"]


def check_header(result: dict[str, Any]) -> None:
    assert result["gpu"] == "cpu" and result["device"] == "cpu" and result["torch"] == torch.__version__
    assert result["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert result["command"].startswith("python3 scripts/bench_tp_serving.py --smoke --part all")
    assert result["hbm"]["bandwidth"] is None and result["hbm"]["floor_ms"] is None
    assert result["hbm"]["weight_bytes_per_gpu"] == result["model"]["weight_bytes_per_gpu"] > 0


def check_cluster(result: dict[str, Any]) -> None:
    command = result["cluster"]["command"]
    assert "pdserve.router.cluster_cli" in command and "--device cpu" in command and "--load-format dummy" in command
    shape = "--prefill-tp 2 --decode-tp 2" if result["part"] == "disagg" else "--colocated"
    assert shape in command and ("--tp 2" in command) == (result["part"] == "colocated")
    assert result["cluster"]["ready_s"] > 0 and result["cluster"]["mps"] is False
    assert set(result["loads"]) == {"warmup", "batch1", "interference"}
    assert [len(g["token_ids"]) for g in result["greedy"]] == [32] * 4
    assert all(len(g["top"][0]) == 5 and g["logprobs"][0] == g["top"][0][0][1] for g in result["greedy"])
    for load in result["loads"].values():
        assert "scripts/bench_serving.py --address 127.0.0.1:" in load["command"] and load["exit_code"] == 0


def check_figures(result: dict[str, Any]) -> None:
    batch1 = result["batch1"]
    assert batch1["completed"] == 2 and batch1["failed"] == 0 and batch1["tpot_over_floor"] is None
    assert batch1["median_tpot_ms"] > 0 and batch1["median_itl_ms"] > 0 and batch1["median_ttft_ms"] > 0
    assert result["reports"]["batch1"]["metrics"]["median_tpot_ms"] == batch1["median_tpot_ms"]
    short, long = result["interference"]["short"], result["interference"]["long"]
    assert short["completed"] > 0 and short["failed"] == 0 and short["median_tpot_ms"] > 0
    assert short["p99_itl_ms"] >= short["median_itl_ms"] > 0 and short["output_throughput"] > 0
    assert long["completed"] == SMOKE_LONG_PROMPTS > 0 and long["failed"] == 0 and long["median_ttft_ms"] > 0
    assert result["interference"]["worker_step_ms"]["p50"] > 0


@pytest.mark.slow
def test_smoke_runs_both_parts_and_writes_every_figure(tmp_path: Path) -> None:
    proc = run_script("--smoke", "--part", "all", "--out", str(tmp_path), "--deadline-s", "420", timeout=480)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["colocated.json", "disagg.json", "summary.json"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["complete"] is True and list(summary["parts"]) == ["disagg", "colocated"]
    for part in ("disagg", "colocated"):
        result = json.loads((tmp_path / f"{part}.json").read_text())
        assert result["part"] == part and result["error"] is None
        check_header(result)
        check_cluster(result)
        check_figures(result)
        assert summary["parts"][part]["batch1_median_tpot_ms"] == result["batch1"]["median_tpot_ms"]
        assert summary["parts"][part]["long_median_ttft_ms"] == result["interference"]["long"]["median_ttft_ms"]
    versus = summary["greedy_vs_reference"]
    assert versus["reference"] == "colocated" and versus["disagg"]["identical"] is True  # NOTE: fp32, same TP size


@pytest.mark.slow
def test_past_the_deadline_it_stops_writes_the_error_and_exits_1(tmp_path: Path) -> None:
    """6 s of work (the deadline less the 30 s kept for stopping): less than the CPU cluster takes to start."""
    proc = run_script("--smoke", "--part", "all", "--out", str(tmp_path), "--deadline-s", "36", timeout=150)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["complete"] is False
    assert all(p["error"].startswith("DeadlineExceeded") for p in summary["parts"].values())
    assert summary["parts"]["colocated"] == {"error": "DeadlineExceeded: not started"}
    assert not (tmp_path / "colocated.json").exists()


def test_parts_an_earlier_run_left_in_out_are_kept_for_the_comparison(script: Any, tmp_path: Path) -> None:
    (tmp_path / "whole.json").write_text(json.dumps({"part": "whole", "date": "d", "greedy": []}))
    (tmp_path / "disagg.json").write_text(json.dumps({"part": "disagg", "date": "d", "greedy": []}))
    assert list(script.earlier_results(tmp_path, ["disagg", "colocated"])) == ["whole"]
