"""router.status on a synthetic run dir: the merged view, the table, which run dir is the default."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.router import status as st


def role(name: str, pid: int | None, restarts: int = 0, uptime_s: float = 12.3) -> dict[str, Any]:
    state = "running" if pid is not None else "restarting"
    return {"name": name, "pid": pid, "state": state, "restarts": restarts, "uptime_s": uptime_s, "log": f"{name}.log"}


def heartbeat(name: str, pid: int, free: int, total: int, running: int, waiting: int, **extra: Any) -> dict[str, Any]:
    kind, worker_id = name.split("-")
    counts = {"num_free_blocks": free, "num_total_blocks": total, "num_running": running, "num_waiting": waiting}
    return {"role": kind, "worker_id": int(worker_id), "pid": pid, "incarnation": "x", **counts, **extra}


def write_run_dir(run_dir: Path, supervisor_pid: int) -> Path:
    """router 101; prefill-0 102 (cache reported); decode-0 103 (stats of an earlier pid); decode-1 restarting."""
    roles = [
        role("router", 101, uptime_s=3725.0),
        role("prefill-0", 102, uptime_s=75.0),
        role("decode-0", 103, restarts=2, uptime_s=1.5),
        role("decode-1", None, restarts=1, uptime_s=0.0),
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").write_text(json.dumps({"pid": supervisor_pid, "ready": True, "roles": roles}))
    stats = run_dir / "stats"
    stats.mkdir()
    prefill = heartbeat("prefill-0", 102, 200, 255, 1, 4, counters={"full_hits": 2, "cached_blocks": 30})
    (stats / "prefill-0.json").write_text(json.dumps(prefill))
    (stats / "decode-0.json").write_text(json.dumps(heartbeat("decode-0", 99, 1, 255, 9, 9)))
    (stats / "decode-1.json").write_text(json.dumps(heartbeat("decode-1", 98, 1, 255, 9, 9)))
    return run_dir


def test_table_merges_roles_with_their_current_heartbeat(tmp_path: Path) -> None:
    status = st.load_status(write_run_dir(tmp_path, os.getpid()))
    assert st.render_table(status).splitlines() == [
        f"pdserve cluster {tmp_path}: supervisor pid {os.getpid()} running, ready",
        "NAME       PID  STATE       UPTIME  RESTARTS  KV USED/FREE/TOTAL  CACHED  RUNNING  WAITING",
        "router     101  running     1h02m   0         -                   -       -        -",
        "prefill-0  102  running     1m15s   0         55/200/255          30      1        4",
        "decode-0   103  running     1.5s    2         -                   -       -        -",
        "decode-1   -    restarting  0.0s    1         -                   -       -        -",
    ]


def test_a_tp_group_is_one_row_with_its_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = write_run_dir(tmp_path, os.getpid())
    status = json.loads((run_dir / "status.json").read_text())
    status["roles"][2] |= {"pid": 123, "ranks": [123, 124]}  # decode-0: TP 2
    status["roles"][1] |= {"ranks": []}  # prefill-0: TP 1
    (run_dir / "status.json").write_text(json.dumps(status))
    (run_dir / "stats" / "decode-0.json").write_text(json.dumps(heartbeat("decode-0", 123, 5, 255, 2, 0)))
    assert st.render_table(st.load_status(run_dir)).splitlines()[1:] == [
        "NAME       PID  RANKS    STATE       UPTIME  RESTARTS  KV USED/FREE/TOTAL  CACHED  RUNNING  WAITING",
        "router     101  -        running     1h02m   0         -                   -       -        -",
        "prefill-0  102  -        running     1m15s   0         55/200/255          30      1        4",
        "decode-0   123  123,124  running     1.5s    2         250/5/255           -       2        0",
        "decode-1   -    -        restarting  0.0s    1         -                   -       -        -",
    ]
    assert st.main(["--run-dir", str(run_dir), "--json"]) == 0
    assert [r["ranks"] for r in json.loads(capsys.readouterr().out)["roles"]] == [[], [], [123, 124], []]


def test_json_keeps_only_heartbeats_of_the_live_pid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert st.main(["--run-dir", str(write_run_dir(tmp_path, os.getpid())), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in out["roles"]] == ["router", "prefill-0", "decode-0", "decode-1"]
    assert [r["stats"] is not None for r in out["roles"]] == [False, True, False, False]
    assert out["roles"][1]["stats"]["counters"] == {"full_hits": 2, "cached_blocks": 30}
    assert out["roles"][1]["stats_age_s"] >= 0
    assert (out["supervisor_pid"], out["supervisor_alive"], out["ready"]) == (os.getpid(), True, True)


def test_dead_supervisor_is_flagged_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dead_pid = 2**22 + 12345  # NOTE: above Linux's default pid_max (4194304), so no process has it
    assert st.main(["--run-dir", str(write_run_dir(tmp_path, dead_pid))]) == 1
    assert "NOT RUNNING" in capsys.readouterr().out.splitlines()[0]


def test_missing_status_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert st.main(["--run-dir", str(tmp_path)]) == 1
    assert "no status.json" in capsys.readouterr().err


def test_default_run_dir_is_the_newest_pdserve_dir(tmp_path: Path) -> None:
    assert st.find_run_dir(tmp_path) is None
    old, new = write_run_dir(tmp_path / "pdserve-old", 1), write_run_dir(tmp_path / "pdserve-new", 1)
    write_run_dir(tmp_path / "other-newest", 1)
    now = time.time()
    os.utime(old / "status.json", (now - 60, now - 60))
    os.utime(new / "status.json", (now - 10, now - 10))
    assert st.find_run_dir(tmp_path) == new


@pytest.mark.parametrize(("seconds", "shown"), [(0.04, "0.0s"), (59.94, "59.9s"), (60, "1m00s"), (7322, "2h02m")])
def test_uptime_format(seconds: float, shown: str) -> None:
    assert st.format_uptime(seconds) == shown


def test_json_lists_each_router_process_with_its_metrics_port(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = write_run_dir(tmp_path, os.getpid())
    status = json.loads((run_dir / "status.json").read_text())
    status["roles"][:1] = [role("router-0", 101), role("router-1", 104)]  # --frontends 2
    (run_dir / "status.json").write_text(json.dumps(status))
    (run_dir / "metrics").mkdir()
    for name, port in (("router-0", 9400), ("router-1", 9404), ("prefill-0", 9401)):
        (run_dir / "metrics" / f"{name}.port").write_text(str(port))
    assert st.main(["--run-dir", str(run_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["roles"]
    assert [(r["name"], r["metrics_port"]) for r in out] == [
        ("router-0", 9400),
        ("router-1", 9404),
        ("prefill-0", 9401),
        ("decode-0", None),
        ("decode-1", None),
    ]
