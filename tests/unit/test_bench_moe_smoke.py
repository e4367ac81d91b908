"""scripts/bench_moe.py --smoke: the MoE benchmark runs end to end on CPU with tiny shapes of both families (the
engine's decode steps at batch 1 and 4 and its prefill; transformers' prefill and decode), observes each step's
routing, and writes HBM-floor byte counts that follow exactly from the tiny shapes; --layers cuts the depth."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.child_env import ROOT, child_env

TOP_K, NUM_EXPERTS = 2, 8
EXPERT_BYTES = 3 * 32 * 64 * 4
"""One tiny expert: gate, up and down projections of width 32 over hidden 64, float32."""
EMBEDDING_ROW = 64 * 4
KV_TOKENS = 24 + 2 + 4 / 2
"""The smoke's context, warm-up steps, and half its timed steps: the timed steps' mean sequence length."""


def run_smoke(out: Path, *flags: str) -> dict[str, Any]:
    argv = [sys.executable, str(ROOT / "scripts" / "bench_moe.py"), "--smoke", "--out", str(out), *flags]
    proc = subprocess.run(argv, cwd=out.parent, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_smoke(tmp_path_factory.mktemp("bench_moe") / "qwen3.json")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench_moe") / "mixtral.json"
    return run_smoke(out, "--shape", "mixtral-8x7b", "--layers", "3", "--no-transformers")


def test_smoke_records_what_ran(qwen3: dict[str, Any]) -> None:
    assert qwen3["gpu"] == "cpu" and qwen3["torch"] and qwen3["triton"]
    assert "scripts/bench_moe.py --smoke --out" in qwen3["command"]
    assert qwen3["model"]["model_type"] == "qwen3_moe" and qwen3["model"]["num_hidden_layers"] == 2
    assert qwen3["setup"]["dtype"] == "float32" and qwen3["setup"]["batches"] == [1, 4]
    assert qwen3["bandwidth_TBps"]["nominal"] is None and qwen3["bandwidth_TBps"]["measured_copy"] > 0
    assert "error" not in qwen3


def test_smoke_times_engine_decode_and_prefill_with_vllm_metric_names(qwen3: dict[str, Any]) -> None:
    engine = qwen3["pdserve"]
    assert engine["decode_graphs"] is False and engine["prefill_graphs"] is False  # NOTE: CPU: eager
    for batch, row in engine["decode"].items():
        assert row["sequences_running"] == int(batch)
        assert 0 < row["min_tpot_ms"] <= row["median_tpot_ms"] <= row["p99_tpot_ms"] and row["mean_tpot_ms"] > 0
        assert row["output_tok_per_s"] > 0 and row["graph_replay_ms"] is None
    prefill = engine["prefill"]
    assert prefill["tokens"] == 64 and 0 < prefill["min_ttft_ms"] <= prefill["median_ttft_ms"]
    assert prefill["median_call_ms"] >= prefill["min_ttft_ms"]


def test_smoke_times_transformers_prefill_and_batch_1_decode(qwen3: dict[str, Any]) -> None:
    hf = qwen3["transformers"]
    assert hf["attn_implementation"] == "sdpa" and hf["version"]
    assert hf["prefill"]["tokens"] == 64 and hf["prefill"]["median_ttft_ms"] > 0
    assert list(hf["decode"]) == ["1"] and hf["decode"]["1"]["median_tpot_ms"] > 0
    assert set(qwen3["transformers_time_over_pdserve"]) == {"prefill_ttft", "decode_tpot_batch1"}


def test_smoke_routing_selects_top_k_experts_per_token(qwen3: dict[str, Any]) -> None:
    decode = qwen3["pdserve"]["decode"]
    assert decode["1"]["distinct_experts_observed"] == {"0": TOP_K, "1": TOP_K}
    assert all(TOP_K <= n <= NUM_EXPERTS for n in decode["4"]["distinct_experts_observed"].values())


def test_smoke_floor_bytes_follow_from_the_shape(qwen3: dict[str, Any]) -> None:
    # per layer: q 64x64, k and v 64x32, o 64x64, q/k norms 16 each, two norms 64 each, router 64x8 (float32);
    # the final norm and the untied lm_head (512 x 64); the embedding counts one row per sequence
    always = (2 * (2 * 64 * 64 + 2 * 64 * 32 + 2 * 16 + 2 * 64 + 64 * 8) + 64 + 512 * 64) * 4
    kv_per_token = 2 * 2 * 2 * 16 * 4  # layers, K and V, KV heads, head_dim, float32
    floors, decode = qwen3["pdserve"]["hbm_floor"], qwen3["pdserve"]["decode"]
    for batch in ("1", "4"):
        experts = sum(decode[batch]["distinct_experts_observed"].values())
        b = int(batch)
        assert floors[batch]["observed_routing"]["bytes"] == {
            "non_expert_weights": always + b * EMBEDDING_ROW,
            "experts": experts * EXPERT_BYTES,
            "kv_cache": b * KV_TOKENS * kv_per_token,
            "total": always + b * EMBEDDING_ROW + experts * EXPERT_BYTES + b * KV_TOKENS * kv_per_token,
        }
        assert floors[batch]["observed_routing"]["floor_ms_nominal"] is None  # NOTE: no nominal bandwidth for CPU
        assert floors[batch]["observed_routing"]["floor_ms_measured_copy"] > 0
    assert floors["1"]["distinct_experts_per_layer"]["uniform_expected"] == TOP_K
    uniform_4 = NUM_EXPERTS * (1 - (1 - TOP_K / NUM_EXPERTS) ** 4)
    assert floors["4"]["distinct_experts_per_layer"]["uniform_expected"] == round(uniform_4, 2)
    assert floors["4"]["uniform_routing"]["bytes"]["experts"] == round(2 * uniform_4 * EXPERT_BYTES)


def test_smoke_cuts_layers_of_the_mixtral_shape(mixtral: dict[str, Any]) -> None:
    assert mixtral["model"]["model_type"] == "mixtral" and mixtral["model"]["num_hidden_layers"] == 3
    assert "transformers" not in mixtral and "error" not in mixtral
    decode = mixtral["pdserve"]["decode"]
    assert decode["1"]["distinct_experts_observed"] == {"0": TOP_K, "1": TOP_K, "2": TOP_K}
    # per layer: attention 2 x 64x64 + 2 x 64x32, two norms, router 64x8 (no q/k norms); final norm; lm_head
    always = (3 * (2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 + 64 * 8) + 64 + 512 * 64) * 4
    bytes_1 = mixtral["pdserve"]["hbm_floor"]["1"]["observed_routing"]["bytes"]
    assert bytes_1["non_expert_weights"] == always + EMBEDDING_ROW
    assert bytes_1["experts"] == 3 * TOP_K * EXPERT_BYTES
    assert bytes_1["kv_cache"] == KV_TOKENS * 3 * 2 * 2 * 16 * 4
