"""scripts/bench_tp_serving.py: the weight bytes behind its HBM floor are transformers' Qwen2 parameter count; --smoke
runs the GPU figure's whole flow on CPU (TP 2 groups over gloo, disaggregated then colocated) and writes every
figure with its commands; past --deadline-s it stops its cluster, writes what it has and exits 1."""

from __future__ import annotations

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
SMOKE_LONG_PROMPTS = len(poisson_times(np.random.default_rng(0), 2.0, 4.0))
"""Long prompts of the smoke's interference load (--long-rate 2, --duration 4, seed 0)."""


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=child_env())


def transformers_params(config: dict[str, Any]) -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**spec))
    return sum(int(p.numel()) for p in model.parameters())


@pytest.mark.parametrize("smoke", [False, True], ids=["qwen2.5-32b", "tiny"])
def test_weight_bytes_per_gpu_are_half_of_transformers_qwen2_parameters(smoke: bool) -> None:
    proc = run_script("--part", "model", *(["--smoke"] if smoke else []), timeout=120)
    assert proc.returncode == 0, proc.stderr
    model = json.loads(proc.stdout)
    assert model["num_params"] == transformers_params(model["config"])
    assert model["tp"] == 2 and model["dtype"] == ("float32" if smoke else "bfloat16")
    assert model["weight_bytes_per_gpu"] == model["num_params"] * (4 if smoke else 2) // 2
    if not smoke:
        assert model["num_params"] == QWEN25_32B_PARAMS


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
