"""Start-up errors of every process (missing model, port in use, bad flag): one clear line naming the problem
and a non-zero exit, no stack dump (GitHub issue 7)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.router.supervisor import TAIL_PREFIX
from tests.e2e.cluster import ROOT
from tests.reliability.report import record

TIMEOUT_S = 60
LAUNCH_TIMEOUT_S = 30
MISSING = "/nonexistent/pdserve-model"


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A port some other process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)


def error_lines(stderr: str) -> list[str]:
    """The lines that state an error (argparse's 'usage:' lines and the log lines pdserve-cluster quotes aside)."""
    lines = [line for line in stderr.splitlines() if not line.startswith(TAIL_PREFIX)]
    return [line for line in lines if "cannot start" in line or "error:" in line]


def check_one_clear_line(case: str, proc: subprocess.CompletedProcess[str], needle: str) -> None:
    lines = error_lines(proc.stderr)
    ok = proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout
    ok = ok and len(lines) == 1 and needle.lower() in lines[0].lower()
    record(f"startup error: {case}", 1, int(not ok), 0, None)
    assert ok, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


def worker_argv(role: str, model: str | Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "-m",
        f"pdserve.{role}_worker",
        "--model",
        str(model),
        "--run-dir",
        str(run_dir),
        "--worker-id",
        "0",
        *extra,
    ]


def router_argv(model: str | Path, run_dir: Path, *extra: str) -> list[str]:
    return ["-m", "pdserve.router", "--model", str(model), "--run-dir", str(run_dir), *extra]


def supervisor_argv(model: str | Path, run_dir: Path, *extra: str) -> list[str]:
    return ["-m", "pdserve.router.cluster_cli", "--model", str(model), "--run-dir", str(run_dir), *extra]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_with_missing_model_says_so(role: str, tmp_path: Path) -> None:
    proc = run(worker_argv(role, MISSING, tmp_path))
    check_one_clear_line(f"{role} worker, missing model", proc, MISSING)


def test_worker_with_bad_flag_gets_usage_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    proc = run(worker_argv("prefill", tiny_llama_dir, tmp_path, "--block-size", "many"))
    check_one_clear_line("prefill worker, bad flag value", proc, "--block-size")


def test_worker_with_bad_block_size_says_so(tiny_llama_dir: Path, tmp_path: Path) -> None:
    proc = run(worker_argv("decode", tiny_llama_dir, tmp_path, "--block-size", "0"))
    check_one_clear_line("decode worker, block size 0", proc, "block")


def test_router_with_missing_model_says_so(tmp_path: Path) -> None:
    proc = run(router_argv(MISSING, tmp_path, "--port", "0"))
    check_one_clear_line("router, missing model", proc, MISSING)


def test_router_on_a_busy_port_says_so(tiny_llama_dir: Path, tmp_path: Path, busy_port: int) -> None:
    proc = run(router_argv(tiny_llama_dir, tmp_path, "--port", str(busy_port)))
    check_one_clear_line("router, port in use", proc, str(busy_port))


@pytest.mark.parametrize(
    ("flags", "needle"),
    [(("--no-such-flag",), "unrecognized"), (("--decode", "0"), "--decode")],
    ids=["unknown", "decode-0"],
)
def test_router_with_bad_flag_gets_usage_error(tmp_path: Path, flags: tuple[str, ...], needle: str) -> None:
    proc = run(router_argv(MISSING, tmp_path, *flags))
    check_one_clear_line(f"router, bad flag {' '.join(flags)}", proc, needle)


def test_supervisor_with_missing_model_exits(tmp_path: Path) -> None:
    proc = run(supervisor_argv(MISSING, tmp_path, "--port", "0"))
    check_one_clear_line("supervisor, missing model", proc, MISSING)
    logs = tmp_path / "logs"
    assert f"before it was ready; the end of its log {logs}/" in proc.stderr  # then the log's last lines, quoted
    assert any(line.startswith(TAIL_PREFIX) and MISSING in line for line in proc.stderr.splitlines())
    assert f"; see {logs}/" in proc.stderr.strip().splitlines()[-1]


def test_supervisor_on_a_busy_port_exits(tiny_llama_dir: Path, tmp_path: Path, busy_port: int) -> None:
    proc = run(supervisor_argv(tiny_llama_dir, tmp_path, "--port", str(busy_port), "--num-blocks", "64"))
    check_one_clear_line("supervisor, port in use", proc, str(busy_port))


@pytest.mark.parametrize(
    ("flags", "needle"),
    [(("--decode", "0"), "--decode"), (("--no-such-flag",), "--no-such-flag")],
    ids=["decode-0", "unknown-worker-flag"],
)
def test_supervisor_with_bad_flag_exits(
    tiny_llama_dir: Path, tmp_path: Path, flags: tuple[str, ...], needle: str
) -> None:
    proc = run(supervisor_argv(tiny_llama_dir, tmp_path, "--port", "0", *flags))
    check_one_clear_line(f"supervisor, bad flag {' '.join(flags)}", proc, needle)
    assert not (tmp_path / "logs").exists(), "a process started despite the bad flag"


@pytest.mark.slow
def test_launch_cluster_with_missing_model_says_why_at_once(tmp_path: Path) -> None:
    """The README's command with a wrong model: it stops within LAUNCH_TIMEOUT_S with the cause on screen."""
    argv = [str(ROOT / "scripts" / "launch_cluster.sh"), "--model", MISSING, "--port", "0", "--run-dir", str(tmp_path)]
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False)
    assert proc.returncode != 0 and time.monotonic() - start < LAUNCH_TIMEOUT_S
    check_one_clear_line("launch_cluster.sh, missing model", proc, MISSING)
