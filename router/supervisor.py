"""Keeps a cluster's processes up: starts each child, restarts one that crashes with exponential backoff, says
why one that cannot start died, and stops the cluster in order (router first, then workers).

A crashed worker's new incarnation shows in its heartbeats: the router fails or re-routes what the old one held
and the prefill workers reclaim its leases. A child is ready once the router wrote its ready line (router) or a
heartbeat with its pid (worker); one that exits before that prints the end of its log, and
RestartPolicy.max_failed_starts such exits in a row (or a startup-error exit before the cluster served) stop
the whole cluster. SIGTERM / SIGINT stop the router first (it finishes streams in flight within its grace
and refuses new calls), then the workers.

Each child leads a process group of its own (start_new_session); a worker's TP ranks 1..N-1 are children of
its rank 0 and stay in that group. A SIGTERM to rank 0 is a worker's normal stop (it stops its ranks); the
group goes with its leader: killed when the leader is killed, and what is left of it killed once the leader
exited, before the leader is reaped (until then its pid, the group's id, cannot be reused).

Why our own supervisor and not circus / supervisord: the roles need a per-cluster run directory for their ipc
sockets and logs, a readiness line that depends on the router having seen every role, and exactly-once
cleanup of the cluster on Ctrl-C; that is a few hundred lines of stdlib here, versus a daemon with its own
config files, sockets and lifecycle to manage around it. Standard library only (no torch: router package).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from pdserve.core.lifecycle import READY_MARK, RESTARTS_ENV, STARTUP_ERROR_EXIT
from pdserve.router.config import HTTP_READY
from pdserve.router.placement import Mps

STOP_MARGIN_S = 5.0
"""Seconds a child gets past its own grace to exit on SIGTERM before it is killed."""
TAIL_PREFIX = "  | "
"""Marks the quoted lines of a child's log on the launcher's stderr."""
STOP_POLL_S = 0.02
"""Seconds between two looks at children stopping."""


class Heartbeat(NamedTuple):
    """What the supervisor reads of a worker's latest heartbeat stats."""

    pid: int
    ranks: list[int]


@dataclass(frozen=True)
class RestartPolicy:
    """When a child is restarted and when the supervisor gives up on it."""

    first_backoff_s: float = 0.5
    """Wait before a restart; it doubles with each exit, up to max_backoff_s."""
    max_backoff_s: float = 10.0
    """Longest wait before a restart."""
    stable_after_s: float = 30.0
    """A ready child that ran this long before it exited restarts after first_backoff_s again."""
    max_failed_starts: int = 3
    """Exits in a row of one child before it became ready that stop the whole cluster."""
    log_tail_lines: int = 15
    """Lines of a child's log shown when it exits before it became ready."""
    poll_s: float = 0.1
    """Seconds between two looks at the children."""


@dataclass
class Child:
    """One supervised process."""

    name: str
    """"router" (or "router-0", "router-1", ... for several front ends), "prefill-0", "decode-1", ..."""
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    backoff: float = RestartPolicy.first_backoff_s
    log_offset: int = 0
    """Size of the log when the current process started."""
    ready: bool = False
    """Whether the current process became ready (router: its ready line; worker: a heartbeat with its pid)."""
    failed_starts: int = 0
    """Processes in a row that exited before they became ready."""
    ranks: list[int] = field(default_factory=list)
    """Pids of the current process's TP group from its ready heartbeat ([] for TP size 1 and until then)."""

    @property
    def role(self) -> str:
        return self.name.split("-")[0]

    def start(self, env: dict[str, str]) -> None:
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns the handle
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self.started_at = time.monotonic()
        self.ready, self.ranks = False, []

    def log_text_since_start(self) -> str:
        """What the current (or last) process wrote to its log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, num_lines: int) -> list[str]:
        """The last num_lines non-empty lines the current (or last) process wrote."""
        return [line for line in self.log_text_since_start().splitlines() if line.strip()][-num_lines:]

    def status(self) -> dict[str, object]:
        alive = self.proc is not None and not exited(self.proc)
        return {
            "name": self.name,
            "pid": self.proc.pid if self.proc else None,
            "ranks": self.ranks if alive else [],
            "state": "running" if alive else "restarting",
            "restarts": self.restarts,
            "uptime_s": round(time.monotonic() - self.started_at, 1) if alive else 0.0,
            "log": str(self.log_path),
        }


class Supervisor:
    def __init__(
        self, children: list[Child], run_dir: Path, env: dict[str, str], grace: float, mps: Mps | None = None,
        gpus: dict[str, str] | None = None, policy: RestartPolicy = RestartPolicy(),
    ) -> None:  # fmt: skip
        self.gpus = gpus or {}
        """Child name -> CUDA_VISIBLE_DEVICES (router/placement.py placement())."""
        self.children = children
        self.grace = grace
        """The router's --grace: how long its streams may take to finish on SIGTERM."""
        self.run_dir = run_dir
        self.env = env
        self.mps = mps
        self.policy = policy
        self.stopping = False
        self.ready = False
        """Whether the cluster served once (the router's ready line; without a router, every worker ready)."""
        self.http_url: str | None = None
        """The router's OpenAI-compatible HTTP API, from its ready line (status.json lists it)."""
        self.failure: str | None = None
        for child in children:
            child.backoff = policy.first_backoff_s

    def run(self, address: str) -> int:
        """Start every child and keep them up until SIGTERM / SIGINT or a child that cannot start; exit code."""
        handlers = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            if self.mps is not None and not self.mps.start(self.env):
                self.mps = None
            for child in self.children:
                child.start(self._env_for(child))
            while not self.stopping:
                self._check_ready(address)
                self._reap_and_restart()
                self._write_status()
                time.sleep(self.policy.poll_s)
            self._shutdown()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if self.failure is not None:
            print(self.failure, file=sys.stderr, flush=True)
            return 1
        return 0

    def _reap_and_restart(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.proc is not None and exited(child.proc):
                self._on_exit(child, now)
            if self.stopping:
                return
            if child.proc is None and now >= child.next_start:
                child.restarts += 1
                child.start(self._env_for(child))

    def _on_exit(self, child: Child, now: float) -> None:
        assert child.proc is not None
        code = end_group(child.proc)
        # NOTE: a child may become ready and exit between two looks: its ready line or heartbeat is still there
        ready = self._update_ready(child)
        child.proc = None
        if ready:
            if now - child.started_at > self.policy.stable_after_s:
                child.backoff = self.policy.first_backoff_s
            print(f"pdserve: {child.name} exited ({code}); restarting in {child.backoff:.1f}s", file=sys.stderr)
            self._schedule_restart(child, now)
            return
        child.failed_starts += 1
        tail = child.log_tail(self.policy.log_tail_lines) or ["(no output)"]
        print(f"pdserve: {child.name} exited ({code}) before it was ready; the end of its log {child.log_path}:",
              *(TAIL_PREFIX + line for line in tail), sep="\n", file=sys.stderr, flush=True)  # fmt: skip
        if code == STARTUP_ERROR_EXIT and not self.ready:  # NOTE: a bad flag or model: restarting cannot help
            self._give_up(f"pdserve: {child.name} failed to start: {tail[-1].strip()}; see {child.log_path}")
        elif child.failed_starts >= self.policy.max_failed_starts:
            times = f"{child.failed_starts} times in a row"
            self._give_up(f"pdserve: {child.name} failed to start {times}; see {child.log_path}")
        else:
            print(f"pdserve: {child.name} restarting in {child.backoff:.1f}s", file=sys.stderr, flush=True)
            self._schedule_restart(child, now)

    def _schedule_restart(self, child: Child, now: float) -> None:
        child.next_start = now + child.backoff
        child.backoff = min(child.backoff * 2, self.policy.max_backoff_s)

    def _give_up(self, failure: str) -> None:
        self.failure = failure
        self.stopping = True

    def _env_for(self, child: Child) -> dict[str, str]:
        env = {**self.env, RESTARTS_ENV: str(child.restarts)}
        if child.name in self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[child.name]
        if self.mps is None:
            return env
        return {**env, **self.mps.worker_env(child.name, child.role, env.get("CUDA_VISIBLE_DEVICES"))}

    def _check_ready(self, address: str) -> None:
        for child in self.children:
            if child.proc is not None:
                self._update_ready(child)
        if self.ready:
            return
        routers = [c for c in self.children if c.role == "router"]
        if routers and all(c.ready for c in routers):  # NOTE: every front end; they share one address
            self.ready = True
            router = routers[0]
            log_text = router.log_text_since_start()
            served = _served_address(log_text) or address  # NOTE: --port 0 picks a free port
            self.http_url = _served_http_url(log_text)
            http = "" if self.http_url is None else f", OpenAI-compatible HTTP on {self.http_url}"
            print(f"pdserve cluster ready on {served} (run dir {self.run_dir}){http}", flush=True)
        elif not routers and all(c.ready for c in self.children):  # NOTE: a host of workers only (--roles)
            self.ready = True
            names = ", ".join(c.name for c in self.children)
            print(f"pdserve workers ready: {names} (run dir {self.run_dir})", flush=True)

    def _update_ready(self, child: Child) -> bool:
        """Whether child's current process became ready; when it just did, its failed starts count from 0 again."""
        if not child.ready and self._is_ready(child):
            child.ready, child.failed_starts = True, 0
        return child.ready

    def _is_ready(self, child: Child) -> bool:
        """Whether child's current process became ready (it may have exited since); a worker's ready heartbeat
        also gives its TP ranks."""
        if child.role == "router":
            # NOTE: logs are appended to: only what this process wrote counts (a reused run dir holds old lines)
            return _served_address(child.log_text_since_start()) is not None
        beat = self._heartbeat(child)
        if child.proc is None or beat is None or beat.pid != child.proc.pid:
            return False
        child.ranks = beat.ranks
        return True

    def _heartbeat(self, child: Child) -> Heartbeat | None:
        """Pid and ranks of child's latest heartbeat stats (None before the first)."""
        try:
            stats = json.loads((self.run_dir / "stats" / f"{child.name}.json").read_text())
            return Heartbeat(int(stats["pid"]), [int(pid) for pid in stats.get("ranks", [])])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def _write_status(self) -> None:
        status = {"pid": os.getpid(), "ready": self.ready, "http_url": self.http_url,
                  "roles": [c.status() for c in self.children]}  # fmt: skip
        tmp = self.run_dir / "status.json.tmp"
        tmp.write_text(json.dumps(status, indent=1))
        tmp.replace(self.run_dir / "status.json")

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _shutdown(self) -> None:
        # NOTE: the router first: it refuses new calls and lets streams in flight finish within its grace,
        # which needs the workers still up; only then are the workers stopped.
        router = [c for c in self.children if c.role == "router"]
        workers = [c for c in self.children if c.role != "router"]
        terminate(router, self.grace + STOP_MARGIN_S)
        terminate(workers, STOP_MARGIN_S)
        if self.mps is not None:
            self.mps.stop(self.env)
        print("pdserve: stopped", file=sys.stderr, flush=True)


def terminate(children: list[Child], timeout: float) -> None:
    """SIGTERM the live ones (a worker's rank 0 stops its own ranks), wait up to `timeout` seconds for all of
    them, then kill each one's process group and reap it: none of their processes is left on return."""
    procs = [c.proc for c in children if c.proc is not None]
    for proc in procs:
        if not exited(proc):  # NOTE: os.kill, not send_signal: that reaps a proc that just exited
            os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(exited(proc) for proc in procs):
        time.sleep(STOP_POLL_S)
    for proc in procs:
        end_group(proc)


def exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether proc exited, without reaping it: its pid, its process group's id, stays taken until end_group."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # NOTE: reaped elsewhere; poll() records it
        return proc.poll() is not None


def end_group(proc: subprocess.Popen[bytes]) -> int:
    """SIGKILL what is left of proc's process group (proc, if it still runs, and its TP ranks), then reap proc;
    its exit code."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def _served_address(router_log: str) -> str | None:
    """The address in the router's ready line (core/lifecycle.py READY_LINE), None before it."""
    line = _ready_line(router_log)
    words = [] if line is None else line[len(READY_MARK) :].split()
    return words[0] if words else None


def _served_http_url(router_log: str) -> str | None:
    """The HTTP API's base URL the router's ready line names (router/config.py HTTP_READY), None without."""
    line = _ready_line(router_log)
    _, mark, url = (line or "").partition(HTTP_READY.split("{url}")[0])
    return url.removesuffix(HTTP_READY.split("{url}")[1]) if mark else None


def _ready_line(router_log: str) -> str | None:
    return next((line.rstrip() for line in router_log.splitlines() if line.startswith(READY_MARK)), None)
