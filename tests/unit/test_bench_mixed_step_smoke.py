"""scripts/bench_mixed_step.py --smoke: a colocated engine's mixed steps on CPU, each carrying a chunk of the arriving
prompt beside every running decode, timed and split into pass and host time, beside the planner's model of them
from a (synthetic) profile."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.child_env import ROOT, child_env
from tests.unit.test_plan_model import PREFILL_BOUND


def test_mixed_steps_are_timed_beside_the_planners_model(tmp_path: Path) -> None:
    profile, out = tmp_path / "profile.json", tmp_path / "mixed.json"
    profile.write_text(json.dumps(PREFILL_BOUND))
    argv = [sys.executable, str(ROOT / "scripts" / "bench_mixed_step.py"), "--smoke", "--profile", str(profile),
            "--out", str(out)]  # fmt: skip
    proc = subprocess.run(argv, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["gpu"] == "cpu" and doc["smoke"] and "bench_mixed_step.py --smoke" in doc["command"]
    assert [(p["chunk"], p["batch"], p["context"]) for p in doc["points"]] == [(16, 1, 24), (16, 4, 24)]
    for point in doc["points"]:
        batch, rows = point["batch"], point["mixed"]
        assert sum(r["tokens"] for r in rows) == 4 * 16  # the prompt's four chunks, each step beside every decode
        assert all(r["decodes"] == batch and r["tokens"] <= 16 - batch for r in rows)
        assert [r["prefix"] for r in rows] == [sum(r["tokens"] for r in rows[:i]) for i in range(len(rows))]
        for r in rows:
            assert 0 < r["gpu_ms"] <= r["step_ms"]
            assert r["host_ms"] == pytest.approx(r["step_ms"] - r["gpu_ms"], abs=1e-3)
        # the profile's model: decode 3 + 0.01 ms a sequence, prefill 5 + 0.5 ms a token (the chunk's marginal cost)
        assert point["decode"]["predicted_ms"] == pytest.approx(3 + 0.01 * batch)
        assert all(r["predicted_ms"] == pytest.approx(3 + 0.01 * batch + 0.5 * r["tokens"]) for r in rows)
        assert point["decode"]["median_step_ms"] > 0
