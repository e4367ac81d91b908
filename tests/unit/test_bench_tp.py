"""scripts/bench_tp.py --smoke: the TP benchmark's every CPU path (engines at TP 1 and 2 over gloo, the gloo
all-reduce, shm handoffs between prefill and decode groups of TP 1 and 2) runs in spawned ranks and writes one
JSON whose figures are all positive, whose all-reduces and handoffs are exact, and whose GPU-only methods say why
they were skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.child_env import ROOT, child_env

BATCHES = ["1", "4"]
PAIRS = ["p1_d1", "p2_d2", "p2_d1", "p1_d2"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench_tp") / "tmp.json"
    argv = [sys.executable, str(ROOT / "scripts" / "bench_tp.py"), "--smoke", "--out", str(out)]
    proc = subprocess.run(argv, cwd=out.parent, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_smoke_records_what_ran(smoke: dict[str, Any]) -> None:
    assert smoke["gpu"] == ["cpu"]
    assert smoke["torch"]
    assert "scripts/bench_tp.py --smoke --out" in smoke["command"]
    assert smoke["env"] == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    assert smoke["setup"]["dtype"] == "float32" and smoke["kv_layout"]["num_kv_heads"] == 2
    assert not any("error" in smoke[part] for part in ("decode", "allreduce", "handoff"))


def test_smoke_times_the_decode_step_at_tp_1_and_2(smoke: dict[str, Any]) -> None:
    decode = smoke["decode"]
    for tp in ("tp1", "tp2", "tp2_one_shot", "tp2_nccl"):
        assert decode[tp]["graphs"] is False and decode[tp]["symmetric_all_reduce"] is False  # NOTE: CPU: gloo
        assert list(decode[tp]["batch"]) == BATCHES
        for batch, row in decode[tp]["batch"].items():
            assert row["sequences_running"] == int(batch)
            assert 0 < row["min_ms"] <= row["median_ms"] and row["mean_ms"] > 0
    for name in ("tp2", "tp2_one_shot", "tp2_nccl"):
        assert list(decode[f"ratio_{name}_vs_tp1"]) == BATCHES
        assert all(ratio > 0 for ratio in decode[f"ratio_{name}_vs_tp1"].values())


def test_smoke_all_reduce_is_exact_and_skips_the_gpu_methods_with_a_reason(smoke: dict[str, Any]) -> None:
    allreduce = smoke["allreduce"]
    assert allreduce["backend"] == "gloo"
    assert allreduce["symm_mem_op"] == "copy_ + torch.ops.symm_mem.one_shot_all_reduce_out"
    assert list(allreduce["nccl_eager"]) == ["1", "8"]
    for row in allreduce["nccl_eager"].values():
        assert row["correct"] is True and 0 < row["min_us"] <= row["median_us"]
    for method in ("nccl_graph", "symm_mem_one_shot_eager", "symm_mem_one_shot_graph"):
        assert allreduce[method] == {"skipped": "no CUDA"}


def test_smoke_handoffs_between_groups_are_exact(smoke: dict[str, Any]) -> None:
    handoff = smoke["handoff"]
    kv = smoke["kv_layout"]
    per_block = kv["num_layers"] * 2 * kv["block_size"] * kv["num_kv_heads"] * kv["head_dim"] * 4
    assert handoff["bytes"] == smoke["setup"]["handoff_blocks"] * per_block
    assert [k for k in handoff if k != "bytes"] == PAIRS
    for pair in PAIRS:
        row = handoff[pair]
        assert row["exact"] is True
        assert 0 < row["min_ms"] <= row["median_ms"] and row["GBps"] > 0 and row["ratio_vs_p1_d1"] > 0
    assert handoff["p1_d1"]["ratio_vs_p1_d1"] == 1.0
