"""`pdserve-status` against a real cluster: every process with its pid, and a killed worker seen restarted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import ROOT, Cluster, running

NAMES = ("router", "prefill-0", "decode-0")


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running(tiny_llama_dir, tmp_path_factory.mktemp("run"), 1, 1, "--num-blocks", "64") as c:
        yield c


def status_command(cluster: Cluster, *flags: str) -> str:
    argv = [sys.executable, "-m", "pdserve.router.status", "--run-dir", str(cluster.run_dir), *flags]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def status_json(cluster: Cluster) -> dict[str, Any]:
    return json.loads(status_command(cluster, "--json"))  # type: ignore[no-any-return]


def table_rows(cluster: Cluster) -> dict[str, list[str]]:
    """The table's rows by role name (the line after the title is the header)."""
    lines = status_command(cluster).splitlines()
    assert lines[1].split()[:3] == ["NAME", "PID", "STATE"]
    return {line.split()[0]: line.split() for line in lines[2:]}


def role(status: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in status["roles"] if r["name"] == name)  # type: ignore[no-any-return]


def test_status_lists_every_process_with_its_pid(cluster: Cluster) -> None:
    cluster.wait_for(lambda: role(status_json(cluster), "decode-0")["stats"] is not None, 10.0, "a heartbeat")
    rows = table_rows(cluster)
    assert sorted(rows) == sorted(NAMES)
    for name in NAMES:
        assert rows[name][1:3] == [str(cluster.pid(name)), "running"]
        assert rows[name][4] == "0"  # restarts
    assert rows["decode-0"][5] == "0/63/63"  # KV blocks used/free/total (block 0 is the null block), all free
    assert rows["router"][5] == "-"  # no KV pool
    status = status_json(cluster)
    assert status["supervisor_alive"] and status["ready"]
    assert role(status, "prefill-0")["stats"]["num_total_blocks"] == 63


def test_status_shows_a_killed_worker_restarted_with_a_new_pid(cluster: Cluster) -> None:
    old_pid = cluster.pid("decode-0")
    os.kill(old_pid, signal.SIGKILL)

    def restarted_and_beating() -> bool:
        decode = role(status_json(cluster), "decode-0")
        return decode["restarts"] == 1 and decode["pid"] != old_pid and decode["stats"] is not None

    cluster.wait_for(restarted_and_beating, 20.0, "decode-0 restarted and heartbeating")
    rows = table_rows(cluster)
    assert rows["decode-0"][1:3] == [str(cluster.pid("decode-0")), "running"]
    assert rows["decode-0"][1] != str(old_pid)
    assert rows["decode-0"][4] == "1"
    assert rows["prefill-0"][4] == rows["router"][4] == "0"
