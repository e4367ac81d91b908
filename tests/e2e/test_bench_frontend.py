"""scripts/bench_frontend.py on CPU: one real router between mock workers (router/benchmark/mock_worker.py), gRPC
door, 1 and 16 closed-loop streams for a second each: every request completes with exactly --output-len tokens
and the JSON carries each level's figures, the host and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.child_env import child_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_frontend.py"
OUTPUT_LEN = 12
LEVEL_KEYS = {
    "concurrency", "client_processes", "duration_s", "completed", "failed", "responses", "output_tokens",
    "responses_per_s", "output_tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
    "itl_p99_ms", "errors",
}  # fmt: skip


@pytest.mark.slow
def test_grpc_levels_complete_every_request_with_exact_output_len(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "frontend.json"
    argv = [sys.executable, str(SCRIPT), "--model", str(tiny_llama_dir), "--concurrency", "1,16", "--duration", "1"]
    argv += ["--warmup", "0", "--input-len", "20", "--output-len", str(OUTPUT_LEN), "--client-processes", "2"]
    argv += ["--result-json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=child_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    levels = report["levels"]
    assert [level["concurrency"] for level in levels] == [1, 16]
    assert [level["client_processes"] for level in levels] == [1, 2]
    for level in levels:
        assert set(level) == LEVEL_KEYS
        assert level["failed"] == 0 and level["errors"] == [] and level["completed"] >= level["concurrency"]
        assert level["output_tokens"] == OUTPUT_LEN * level["completed"]
        assert level["responses"] >= level["completed"]
        assert level["output_tokens_per_s"] > 0 and level["ttft_p99_ms"] >= level["ttft_p50_ms"] > 0
    assert report["argv"][1:] == argv[2:]
    assert report["host"]["num_cpus"] >= 1 and "cpu" in report["host"]
    assert report["config"]["backend"] == "grpc" and report["config"]["output_len"] == OUTPUT_LEN
    assert "TTFT p50 ms" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_two_front_ends_on_one_port_complete_every_request(tiny_llama_dir: Path, tmp_path: Path, backend: str) -> None:
    """--frontends 2: the mock workers send each request's tokens to the router that owns it; one sent to the
    other would never reach its stream, and the level would fail."""
    out = tmp_path / "frontend.json"
    argv = [sys.executable, str(SCRIPT), "--model", str(tiny_llama_dir), "--backend", backend, "--frontends", "2"]
    argv += ["--concurrency", "16", "--duration", "1", "--warmup", "0", "--input-len", "20"]
    argv += ["--output-len", str(OUTPUT_LEN), "--client-processes", "2", "--result-json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=child_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    (level,) = report["levels"]
    assert level["failed"] == 0 and level["completed"] >= 16
    assert level["output_tokens"] == OUTPUT_LEN * level["completed"]
    assert report["config"]["frontends"] == 2 and report["config"]["grpc_channels"] == 8
    assert "2 routers on one port" in proc.stdout
