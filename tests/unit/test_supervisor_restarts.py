"""router/supervisor.py with fake children: a child that exits before it became ready shows the end of its log
and where the log is; three such exits in a row stop the cluster; a child that became ready and then crashed is
restarted, and becoming ready starts the count of failed starts anew."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from pdserve.core.lifecycle import READY_LINE
from pdserve.router.supervisor import TAIL_PREFIX, Child, RestartPolicy, Supervisor, terminate

FAST = RestartPolicy(first_backoff_s=0.01, max_backoff_s=0.02, poll_s=0.01)

FAKE_WORKER = """
import json, os, pathlib, signal, sys, time
counter, steps, stats = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
n = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(n + 1))
print(f"incarnation {n}: {steps[n]}", flush=True)
if steps[n] == "f":  # fails before it is ready
    print("boom: bad model", flush=True)
    sys.exit(int(sys.argv[4]))
stats.parent.mkdir(exist_ok=True)
stats.write_text(json.dumps({"pid": os.getpid()}))  # ready: a heartbeat with its pid
if steps[n] == "s":  # stays up and stops the supervisor (its parent: the test process)
    os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(60)
time.sleep(0.1)  # "r": ready, then crashes
sys.exit(1)
"""
"""One incarnation per letter of steps: f fails before it is ready, r crashes after, s stays up and stops the test."""


def fake_worker(tmp_path: Path, steps: str, exit_code: int = 1) -> Child:
    stats = tmp_path / "stats" / "prefill-0.json"
    argv = [sys.executable, "-c", FAKE_WORKER, str(tmp_path / "count"), steps, str(stats), str(exit_code)]
    return Child("prefill-0", argv, tmp_path / "prefill-0.log")


def supervise(tmp_path: Path, *children: Child) -> int:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return Supervisor(list(children), tmp_path, env, grace=1.0, policy=FAST).run("127.0.0.1:0")


def test_three_failed_starts_in_a_row_stop_the_cluster_with_the_log_tail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    child = fake_worker(tmp_path, "ffffs")
    assert supervise(tmp_path, child) != 0
    err = capsys.readouterr().err
    assert child.restarts == 2, err
    assert err.count(f"pdserve: prefill-0 exited (1) before it was ready; the end of its log {child.log_path}:") == 3
    assert err.count(f"{TAIL_PREFIX}boom: bad model") == 3 and f"{TAIL_PREFIX}incarnation 2: f" in err
    last = err.strip().splitlines()[-1]
    assert last == f"pdserve: prefill-0 failed to start 3 times in a row; see {child.log_path}"


def test_a_startup_error_exit_stops_the_cluster_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    child = fake_worker(tmp_path, "ffs", exit_code=2)
    assert supervise(tmp_path, child) != 0
    err = capsys.readouterr().err
    assert child.restarts == 0 and f"{TAIL_PREFIX}boom: bad model" in err
    last = err.strip().splitlines()[-1]
    assert last == f"pdserve: prefill-0 failed to start: boom: bad model; see {child.log_path}"


def test_a_child_that_was_ready_is_restarted_and_ready_resets_the_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    child = fake_worker(tmp_path, "ffrffrs")  # 4 failed starts, never 3 in a row
    assert supervise(tmp_path, child) == 0
    err = capsys.readouterr().err
    assert child.restarts == 6, err
    assert err.count("before it was ready") == 4 and err.count("pdserve: prefill-0 exited (1); restarting in") == 2
    assert "in a row" not in err


def test_the_cluster_is_ready_once_the_router_logs_its_ready_line_and_says_its_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ready = READY_LINE.format(address="127.0.0.1:1")
    # NOTE: the pause lets the supervisor (polling every 10 ms) see the line before it is told to stop
    code = f"import os, signal, time; print({ready!r}, flush=True); time.sleep(0.5); os.kill(os.getppid(), 15)"
    code += "; time.sleep(60)"
    router = Child("router", [sys.executable, "-c", code], tmp_path / "router.log")
    assert supervise(tmp_path, router) == 0
    out = capsys.readouterr()
    # NOTE: the address the router serves on (it picks a free port for --port 0), not the requested 127.0.0.1:0
    assert router.ready and "pdserve cluster ready on 127.0.0.1:1 (" in out.out and "before it was ready" not in out.err


def test_a_child_seen_only_after_it_exited_counts_as_ready_if_it_heartbeat(tmp_path: Path) -> None:
    child = fake_worker(tmp_path, "r")  # writes its heartbeat, then crashes
    child.failed_starts = FAST.max_failed_starts - 1
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    supervisor = Supervisor([child], tmp_path, env, grace=1.0, policy=FAST)
    child.start(env)
    assert child.proc is not None and child.proc.wait(timeout=30) == 1
    supervisor._reap_and_restart()  # the supervisor's first look at it
    assert child.ready and child.failed_starts == 0 and not supervisor.stopping and child.proc is None


def test_several_front_ends_make_the_cluster_ready_only_once_every_one_wrote_its_ready_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ready = READY_LINE.format(address="127.0.0.1:7")
    codes = [f"import time; time.sleep({pause}); print({ready!r}, flush=True); time.sleep(60)" for pause in (0, 1)]
    routers = [Child(f"router-{k}", [sys.executable, "-c", code], tmp_path / f"router-{k}.log")
               for k, code in enumerate(codes)]  # fmt: skip
    supervisor = Supervisor(routers, tmp_path, {**os.environ, "PYTHONUNBUFFERED": "1"}, grace=1.0, policy=FAST)
    for child in routers:
        child.start(supervisor.env)
    try:
        deadline = time.monotonic() + 20
        while not routers[0].ready and time.monotonic() < deadline:
            supervisor._check_ready("127.0.0.1:0")
        assert routers[0].ready and not routers[1].ready and not supervisor.ready  # router-1 is still starting
        while not supervisor.ready and time.monotonic() < deadline:
            supervisor._check_ready("127.0.0.1:0")
        assert routers[1].ready and capsys.readouterr().out.count("pdserve cluster ready on 127.0.0.1:7 (") == 1
    finally:
        terminate(routers, 1.0)
