"""`pdserve-status`: one line per process of a running cluster, from the files its supervisor and workers write.

    pdserve-status                            the newest cluster under the temp dir (the supervisor's default)
    pdserve-status --run-dir DIR --json       one cluster, as merged JSON

Reads {run_dir}/status.json (the supervisor, every 0.1 s: name, pid, TP ranks, state, restarts, uptime_s and
log of each role) and {run_dir}/stats/{role}-{i}.json (each worker's latest heartbeat: KV blocks, running and
waiting requests, counters) and {run_dir}/metrics/{role}.port (each process's Prometheus port, in --json: every
router process of a cluster with several front ends, router-0..K-1, serves its own).
Exit status 1 when there is no status to show or the supervisor that wrote it is gone.
Standard library only: the router package never imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUN_DIR_PREFIX = "pdserve-"
"""pdserve-cluster (router/cluster_cli.py) without --run-dir makes tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)."""
COLUMNS = ("NAME", "PID", "STATE", "UPTIME", "RESTARTS", "KV USED/FREE/TOTAL", "CACHED", "RUNNING", "WAITING")
RANKS_COLUMN = "RANKS"
"""After PID, only when a worker runs as a TP group of more than one process."""


@dataclass(frozen=True)
class RoleStatus:
    """One supervised process, with its worker's latest heartbeat."""

    name: str
    """"router", "prefill-0", "decode-1", ..."""
    pid: int | None
    """None while the supervisor waits to restart it."""
    state: str
    """"running" or "restarting"."""
    restarts: int
    uptime_s: float
    log: str
    ranks: tuple[int, ...]
    """Pids of the worker's TP group in rank order, pid first (() for TP size 1 and until its ready heartbeat)."""
    stats: dict[str, Any] | None
    """The heartbeat of this very process (same pid); None for the router and until a new one beats."""
    stats_age_s: float | None
    """Seconds since that heartbeat was written."""
    metrics_port: int | None = None
    """The Prometheus port the process (its latest incarnation) serves, None without metrics."""


@dataclass(frozen=True)
class ClusterStatus:
    """What `pdserve-status` shows for one run dir."""

    run_dir: str
    supervisor_pid: int
    supervisor_alive: bool
    ready: bool
    roles: tuple[RoleStatus, ...]


def find_run_dir(base: Path) -> Path | None:
    """The run dir under base whose status.json changed last (a live supervisor rewrites its own every 0.1 s)."""
    found = [(p.stat().st_mtime, p.parent) for p in base.glob(f"{RUN_DIR_PREFIX}*/status.json")]
    return max(found)[1] if found else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_stats(path: Path, pid: int | None, now: float) -> tuple[dict[str, Any] | None, float | None]:
    """path's heartbeat and its age, if the process with pid wrote it (not an earlier incarnation)."""
    try:
        stats = json.loads(path.read_text())
        age = now - path.stat().st_mtime
    except (FileNotFoundError, json.JSONDecodeError):
        return None, None
    if pid is None or stats.get("pid") != pid:
        return None, None
    return stats, round(age, 1)


def read_port(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def load_status(run_dir: Path) -> ClusterStatus:
    """Merge status.json with the stats files; FileNotFoundError when the supervisor never wrote one."""
    raw = json.loads((run_dir / "status.json").read_text())
    now = time.time()
    roles = []
    for role in raw["roles"]:
        stats, age = read_stats(run_dir / "stats" / f"{role['name']}.json", role["pid"], now)
        head = (role["name"], role["pid"], role["state"], int(role["restarts"]), float(role["uptime_s"]), role["log"])
        ranks = tuple(int(pid) for pid in role.get("ranks", []))  # NOTE: absent from an older supervisor's file
        port = read_port(run_dir / "metrics" / f"{role['name']}.port")
        roles.append(RoleStatus(*head, ranks=ranks, stats=stats, stats_age_s=age, metrics_port=port))
    pid = int(raw["pid"])
    return ClusterStatus(str(run_dir), pid, pid_alive(pid), bool(raw["ready"]), tuple(roles))


def format_uptime(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def role_row(role: RoleStatus, with_ranks: bool = False) -> tuple[str, ...]:
    """The table cells of one role; "-" where there is nothing to show. with_ranks: a RANKS cell after PID."""
    pid = str(role.pid) if role.pid is not None else "-"
    ranks = (",".join(map(str, role.ranks)) if len(role.ranks) > 1 else "-",) if with_ranks else ()
    head = (role.name, pid, *ranks, role.state, format_uptime(role.uptime_s), str(role.restarts))
    s = role.stats
    if s is None:
        return (*head, "-", "-", "-", "-")
    free, total = s["num_free_blocks"], s["num_total_blocks"]
    cached = s.get("counters", {}).get("cached_blocks")  # NOTE: not in every heartbeat; shown when reported
    return (
        *head,
        f"{total - free}/{free}/{total}",
        "-" if cached is None else str(cached),
        str(s.get("num_running", "-")),
        str(s.get("num_waiting", "-")),
    )


def render_table(status: ClusterStatus) -> str:
    """A header line about the cluster, then one aligned row per role (a RANKS column where a TP group runs)."""
    alive = "running" if status.supervisor_alive else "NOT RUNNING (last state it wrote)"
    ready = "ready" if status.ready else "starting"
    title = f"pdserve cluster {status.run_dir}: supervisor pid {status.supervisor_pid} {alive}, {ready}"
    with_ranks = any(len(r.ranks) > 1 for r in status.roles)
    columns = (*COLUMNS[:2], RANKS_COLUMN, *COLUMNS[2:]) if with_ranks else COLUMNS
    rows = [columns, *(role_row(r, with_ranks) for r in status.roles)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join([title, *lines])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve-status", description="Show the processes of a running pdserve cluster.")
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help=f"the cluster's run dir (default: the newest {tempfile.gettempdir()}/{RUN_DIR_PREFIX}*)",
    )
    p.add_argument("--json", action="store_true", help="print the merged status as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = args.run_dir or find_run_dir(Path(tempfile.gettempdir()))
    if run_dir is None:
        print(f"pdserve-status: no {RUN_DIR_PREFIX}* run dir under {tempfile.gettempdir()}", file=sys.stderr)
        return 1
    try:
        status = load_status(run_dir)
    except FileNotFoundError:
        print(f"pdserve-status: no status.json in {run_dir}", file=sys.stderr)
        return 1
    print(json.dumps(dataclasses.asdict(status), indent=1) if args.json else render_table(status))
    return 0 if status.supervisor_alive else 1


if __name__ == "__main__":
    sys.exit(main())
