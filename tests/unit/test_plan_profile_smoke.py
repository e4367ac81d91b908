"""scripts/profile_layout.py --smoke: the engine's prefill and decode grid on CPU with a tiny shape, written as a
profile the planner reads and plans from (no timing claims)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pdserve.router.plan import cli as plan_cli
from pdserve.router.plan.profile import Profile
from tests.child_env import ROOT, child_env


def test_smoke_profile_is_read_and_planned_from(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    argv = [sys.executable, str(ROOT / "scripts" / "profile_layout.py"), "--smoke", "--gpus", "2", "--out", str(out)]
    proc = subprocess.run(argv, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["gpu"] == "cpu" and doc["model"]["smoke"] and doc["model"]["max_model_len"] == 512
    profile = Profile.read(out)
    assert profile.prefill_tokens == (16, 64, 128) and profile.prefill_budget == 64
    assert profile.decode_batches == (1, 4) and profile.decode_contexts == (32, 128)
    assert all(ms > 0 for ms in profile.prefill_ms) and all(ms > 0 for row in profile.decode_ms for ms in row)
    assert profile.kv_capacity_tokens == 255 * 16 and profile.num_gpus == 2
    argv = ["--profile", str(out), "--workload", "chat", "--slo", "ttft:60000,tpot:10000", "--num-requests", "60"]
    plan = plan_cli.plan(plan_cli.build_parser().parse_args(argv))
    assert plan["num_gpus"] == 2 and len(plan["layouts"]) == 5 and plan["recommended"] is not None
    assert plan["workload"]["max_model_len"] == 512
