"""router/supervisor.py with a fake TP worker (rank 0 that starts a rank of its own, as a real one starts ranks
1..N-1): stop sends SIGTERM to rank 0 only, and whatever way rank 0 ends (stops, is killed, crashes), its ranks
do not outlive it; the supervisor's status lists the ranks of the group's ready heartbeat."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from pdserve.router.supervisor import Child, RestartPolicy, Supervisor, terminate

RANK = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: (out / "rank_got_sigterm").write_text("1"))
(out / "rank.pid").write_text(str(__import__("os").getpid()))
time.sleep(60)
"""
"""A TP rank: sleeps; a SIGTERM it gets is written down, not obeyed (only a kill ends it)."""

RANK0 = """
import json, os, pathlib, signal, subprocess, sys, time
mode, out, rank_src = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
rank = subprocess.Popen([sys.executable, "-c", rank_src, str(out)])
while not (out / "rank.pid").exists():
    time.sleep(0.01)
if mode == "crash":
    sys.exit(1)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stuck" else lambda *_: sys.exit(0))
stats = out / "stats" / "decode-0.json"
stats.parent.mkdir(exist_ok=True)
stats.write_text(json.dumps({"pid": os.getpid(), "ranks": [os.getpid(), rank.pid]}))
deadline = time.monotonic() + 10
while mode == "serve" and time.monotonic() < deadline:  # stops the supervisor once its status lists the ranks
    try:
        if json.loads((out / "status.json").read_text())["roles"][0]["ranks"]:
            break
    except Exception:  # NOTE: no status (or no ranks in it) yet; after the deadline it stops the test anyway
        pass
    time.sleep(0.01)
if mode == "serve":
    os.kill(os.getppid(), signal.SIGTERM)
time.sleep(60)
"""
"""Rank 0 of a TP-2 worker. crash: exits 1 before it is ready; stuck: ignores SIGTERM; serve: ready, exits on
SIGTERM without stopping its rank (the straggler the supervisor must kill), and stops the test's supervisor."""


def tp_worker(tmp_path: Path, mode: str) -> Child:
    argv = [sys.executable, "-c", RANK0, mode, str(tmp_path), RANK]
    return Child("decode-0", argv, tmp_path / "decode-0.log")


def gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether pid ends (or is a zombie no one reaped: the kill took it) within within_s seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.02)
    return False


def rank_pid(tmp_path: Path) -> int:
    return int((tmp_path / "rank.pid").read_text())


def wait_for(path: Path, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")


def test_a_stop_sigterms_rank_0_only_and_takes_the_ranks_it_left(tmp_path: Path) -> None:
    child = tp_worker(tmp_path, "serve")
    policy = RestartPolicy(first_backoff_s=0.01, poll_s=0.01)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    assert Supervisor([child], tmp_path, env, grace=1.0, policy=policy).run("127.0.0.1:0") == 0
    status = json.loads((tmp_path / "status.json").read_text())["roles"][0]
    assert status["ranks"] == [status["pid"], rank_pid(tmp_path)]
    assert gone(rank_pid(tmp_path))
    assert not (tmp_path / "rank_got_sigterm").exists()  # the stop signal is rank 0's to pass on


def test_a_rank_0_that_ignores_sigterm_is_killed_with_its_ranks(tmp_path: Path) -> None:
    child = tp_worker(tmp_path, "stuck")
    child.start({**os.environ})
    wait_for(tmp_path / "stats" / "decode-0.json")
    terminate([child], timeout=0.2)
    assert child.proc is not None and child.proc.returncode == -9
    assert gone(rank_pid(tmp_path))


def test_the_ranks_of_a_crashed_rank_0_go_before_it_restarts(tmp_path: Path) -> None:
    child = tp_worker(tmp_path, "crash")
    policy = RestartPolicy(first_backoff_s=0.01, poll_s=0.01, max_failed_starts=1)
    assert Supervisor([child], tmp_path, {**os.environ}, grace=1.0, policy=policy).run("127.0.0.1:0") == 1
    assert gone(rank_pid(tmp_path))
