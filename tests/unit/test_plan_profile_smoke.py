"""scripts/profile_layout.py --smoke: the engine's prefill and decode grid on CPU with a tiny shape, written as a
profile the planner reads and plans from (no timing claims); at --tp 2 (two gloo ranks), added to the profile's
"tp" section, whose TP layouts the planner then compares."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.router.plan import cli as plan_cli
from pdserve.router.plan.profile import Profile
from tests.child_env import ROOT, child_env
from tests.unit.test_plan_model import profile_doc


def run_smoke(tmp_path: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """profile_layout.py --smoke --out out, and extra."""
    argv = [sys.executable, str(ROOT / "scripts" / "profile_layout.py"), "--smoke", "--out", str(out), *extra]
    return subprocess.run(argv, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)


def stand_in_profile(out: Path) -> dict:
    """Writes a TP-1 profile of the smoke shape on cpu at out, standing for `--smoke` at TP 1 (the test below runs
    that) for the calls that add to it; the document."""
    doc = profile_doc(0.1, 1.0, 1.0, 0.1) | {"gpu": "cpu", "model": {"shape": "llama-8b", "smoke": True}}
    out.write_text(json.dumps(doc))
    return doc


def test_smoke_profile_is_read_and_planned_from(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    proc = run_smoke(tmp_path, out, "--gpus", "2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["gpu"] == "cpu" and doc["model"]["smoke"] and doc["model"]["max_model_len"] == 512
    profile = Profile.read(out)
    assert profile.prefill_tokens == (16, 64, 128) and profile.prefill_budget == 64
    assert profile.decode_batches == (1, 4) and profile.decode_contexts == (32, 128)
    assert all(ms > 0 for ms in profile.prefill_ms) and all(ms > 0 for row in profile.decode_ms for ms in row)
    assert profile.kv_capacity_tokens == 255 * 16 and profile.num_gpus == 2
    argv = ["--profile", str(out), "--workload", "chat", "--slo", "ttft:60000,tpot:10000", "--duration-s", "10"]
    plan = plan_cli.plan(plan_cli.build_parser().parse_args(argv))
    assert plan["num_gpus"] == 2 and len(plan["layouts"]) == 5 and plan["recommended"] is not None
    assert plan["workload"]["max_model_len"] == 512


def test_smoke_profile_at_tp_2_adds_a_tp_section_the_planner_compares(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    refused = run_smoke(tmp_path, out, "--tp", "2")
    assert refused.returncode == 2 and "profile TP 1 into" in refused.stderr and not out.exists()
    one = stand_in_profile(out)
    proc = run_smoke(tmp_path, out, "--tp", "2")  # NOTE: two gloo ranks on CPU
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert {k: v for k, v in doc.items() if k != "tp"} == one and list(doc["tp"]) == ["2"]
    assert "--tp 2" in doc["tp"]["2"]["command"]
    profile = Profile.read(out)
    tp2 = profile.at_tp(2)
    assert profile.tp_sizes == (1, 2) and tp2.prefill_tokens == (16, 64, 128) and tp2.prefill_budget == 64
    assert tp2.decode_batches == (1, 4) and tp2.decode_contexts == (32, 128) and tp2.kv_capacity_tokens == 255 * 16
    assert all(ms > 0 for ms in tp2.prefill_ms) and all(ms > 0 for row in tp2.decode_ms for ms in row)
    argv = ["--profile", str(out), "--workload", "chat", "--slo", "ttft:60000,tpot:10000", "--duration-s", "10"]
    plan = plan_cli.plan(plan_cli.build_parser().parse_args(argv))
    names = [row["layout"] for row in plan["layouts"]]
    assert plan["num_gpus"] == 3 and names[-2:] == ["1P:1D(tp2)", "1P(tp2):1D"]
    plan = plan_cli.plan(plan_cli.build_parser().parse_args([*argv, "--gpus", "2"]))
    assert [row["layout"] for row in plan["layouts"]][5:] == [
        "colocated-tp2-c512",
        "colocated-tp2-c2048",
        "1P(tp2):1D(tp2)-shared",
    ]


def test_smoke_chunks_add_each_chunk_sizes_passes_by_prefix(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    refused = run_smoke(tmp_path, out, "--chunks")
    assert refused.returncode == 2 and "--chunks adds to the TP-1 profile" in refused.stderr and not out.exists()
    one = stand_in_profile(out)
    assert run_smoke(tmp_path, out, "--chunks", "--tp", "2").returncode == 2
    proc = run_smoke(tmp_path, out, "--chunks")
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert {k: v for k, v in doc.items() if k != "chunks"} == one and "--chunks" in doc["chunks"]["command"]
    points = Profile.read(out).chunk_points
    # NOTE: the smoke shape's context is 512: passes of 64 at prefixes 0..448 (the last one a token short)
    assert [(c, p) for c, p, _ in points] == [(64, 64 * k) for k in range(8)] + [(128, 128 * k) for k in range(4)]
    assert all(ms > 0 for _, _, ms in points)


def test_smoke_mps_adds_each_roles_slowdown_per_share_alone_and_beside_the_other(tmp_path: Path) -> None:
    """On CPU there is no MPS: the children run as they are (the load beside a measurement too), so this checks the
    flow and the section, not factors."""
    out = tmp_path / "profile.json"
    refused = run_smoke(tmp_path, out, "--mps", "50")
    assert refused.returncode == 2 and "--mps adds to the TP-1 profile" in refused.stderr and not out.exists()
    one = stand_in_profile(out)
    assert (
        run_smoke(tmp_path, out, "--mps", "0,50").returncode == 2
        and run_smoke(tmp_path, out, "--mps", "50", "--tp", "2").returncode == 2
    )
    proc = run_smoke(tmp_path, out, "--mps", "30,50")
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert {k: v for k, v in doc.items() if k != "mps_slowdown"} == one
    assert "--mps 30,50" in doc["mps_slowdown"]["command"]
    assert [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("MPS share")] == [
        "MPS share 100%", "MPS share 30%", "MPS share 50%", "MPS share 30% beside 70%", "MPS share 30% beside 70%",
        "MPS share 50% beside 50%", "MPS share 50% beside 50%"]  # fmt: skip
    profile = Profile.read(out)
    for factors in (profile.mps_slowdown, profile.mps_with_other):  # alone; with the other role's load beside
        assert set(factors) == {"prefill", "decode"} and all(set(by) == {30, 50} for by in factors.values())
        assert all(factor > 0 for by in factors.values() for factor in by.values())
    assert profile.slowdown("decode", 0.5) == pytest.approx(max(1.0, profile.mps_with_other["decode"][50]))


def test_smoke_handoff_adds_the_kv_copy_per_prompt_token(tmp_path: Path) -> None:
    """On CPU the copy is torch's reference within one device: this checks the flow, the section and that the
    planner reads the slope, not a GPU's figure."""
    out = tmp_path / "profile.json"
    refused = run_smoke(tmp_path, out, "--handoff")
    assert refused.returncode == 2 and "--handoff adds to the TP-1 profile" in refused.stderr and not out.exists()
    one = stand_in_profile(out)
    proc = run_smoke(tmp_path, out, "--handoff")
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert {k: v for k, v in doc.items() if k != "handoff"} == {k: v for k, v in one.items() if k != "handoff"}
    handoff = doc["handoff"]
    assert "--handoff" in handoff["command"] and handoff["copy"] == "within cpu"
    assert handoff["fixed_ms"] == one["handoff"]["fixed_ms"]  # NOTE: the messages' part is not measured here
    assert [p["tokens"] for p in handoff["points"]] == [16, 64, 128] and all(p["ms"] > 0 for p in handoff["points"])
    assert Profile.read(out).handoff_ms_per_token == handoff["ms_per_token"] >= 0
