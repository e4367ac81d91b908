"""`launch_cluster.sh --plan PROFILE --workload NAME --slo ...`: pdserve-plan's --launch-flags pass the launcher's
own checks for the layout it recommends, and the script starts that layout (a tiny CPU cluster)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from pdserve.router import cluster_cli
from pdserve.router.plan import cli as plan_cli
from tests.e2e.cluster import ROOT, free_port
from tests.unit.test_plan_model import PREFILL_BOUND

PLAN_ARGS = ["--workload", "long-input", "--slo", "ttft:10000,itl_p99:50", "--duration-s", "10"]
"""A prompt stalls colocated decodes far past the ITL SLO: the plan is disaggregated (1P:1D-shared on 1 GPU)."""


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PREFILL_BOUND | {"num_gpus": 1}))
    return path


def launch_flags(profile: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert plan_cli.main(["--profile", str(profile), *PLAN_ARGS, "--launch-flags"]) == 0
    return capsys.readouterr().out.split()


def test_plan_flags_pass_the_launchers_checks(
    profile: Path, tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = launch_flags(profile, capsys)
    assert flags == ["--max-num-seqs", "128", "--prefill", "1", "--decode", "1", "--prefill-gpus", "0",
                     "--decode-gpus", "0", "--mps-split", "50/50"]  # fmt: skip
    parser = cluster_cli.build_parser()
    args, rest = cluster_cli.parse_args(parser, ["--model", str(tiny_llama_dir), "--device", "cuda", *flags])
    plan = cluster_cli.plan_cluster(args, rest, tmp_path / "run")
    assert sorted(c.name for c in plan.children) == ["decode-0", "prefill-0", "router"]
    assert args.gpus == {"prefill-0": "0", "decode-0": "0"} and args.mps_shares == (50, 50)
    decode = next(c for c in plan.children if c.name == "decode-0")
    assert decode.argv[decode.argv.index("--max-num-seqs") + 1] == "128"


@pytest.mark.slow
def test_launch_cluster_starts_the_planned_layout(profile: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    port, run_dir = free_port(), tmp_path / "run"
    argv = [str(ROOT / "scripts" / "launch_cluster.sh"), "--model", str(tiny_llama_dir), "--device", "cpu"]
    argv += ["--plan", str(profile), "--workload", "long-input", "--slo", "ttft:10000,itl_p99:50"]
    argv += ["--port", str(port), "--run-dir", str(run_dir), "--metrics-port", "0", "--http-port", "0"]
    argv += ["--num-blocks", "128"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not any("pdserve cluster ready on" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        roles = {r["name"] for r in json.loads((run_dir / "status.json").read_text())["roles"]}
        assert roles == {"router", "prefill-0", "decode-0"}
        assert any("pdserve-plan's layout for long-input" in line and "--prefill 1" in line for line in lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_plan_without_workload_or_slo_is_refused(profile: Path) -> None:
    argv = ["bash", str(ROOT / "scripts" / "launch_cluster.sh"), "--plan", str(profile), "--device", "cpu"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "go together" in proc.stderr
