"""A worker's TP group as processes: rank 0 (the worker the supervisor started) and the ranks it starts.

Rank 0 owns everything a worker of TP size 1 owns (scheduler, block pool, ZMQ traffic with the router and the
other workers). It starts ranks 1..N-1 as its children, which die with it (PR_SET_PDEATHSIG), and sends each of
them every pass before it runs it (ModelRunner.fanout: one frame per rank per step over an ipc:// PUSH), plus
the KV pulls and pool openings of a decode group. The ranks answer on one PULL socket of rank 0: ready once
warmed up (with their pools' descriptors), and which pulls have finished.

The group lives and dies as a unit: rank 0 exits as soon as any other rank does, so the supervisor restarts the
whole group, and a rank that dies mid-collective never leaves the others waiting for it (the collectives'
timeout, core/parallel.py GROUP_TIMEOUT, covers a rank that hangs instead).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import zmq

from pdserve.core import ipc
from pdserve.core.lifecycle import STARTUP_ERROR_EXIT
from pdserve.core.messages import (
    Message,
    RankPullCmd,
    RankPullDoneEvent,
    RankReadyEvent,
    RankStopCmd,
    encode,
)

log = logging.getLogger(__name__)
LEADER_ENV = "PDSERVE_TP_LEADER"
"""Set for ranks > 0: rank 0's pid (a rank whose parent is already another process exits at once)."""
READY_TIMEOUT_S = 600.0
"""How long rank 0 waits, after its own start-up, for the other ranks' ready events."""
STOP_TIMEOUT_S = 10.0
"""How long the ranks get to leave after RankStopCmd before they are killed."""
PR_SET_PDEATHSIG = 1


def group_paths(prefix: str) -> tuple[str, str]:
    """(torch.distributed init_method, rank 0's events address) of the group whose files start with prefix."""
    return f"file://{prefix}.store", f"ipc://{prefix}.ranks.sock"


def rank_addr(prefix: str, rank: int) -> str:
    """Where rank (> 0) receives rank 0's commands."""
    return f"ipc://{prefix}.rank{rank}.sock"


class RankGroup:
    """Rank 0's side of the group: the other ranks' processes, command sockets and events."""

    def __init__(self, ctx: zmq.Context, run_dir: str, name: str, size: int, argv: list[str]) -> None:
        """Start ranks 1..size-1 as `python <argv> --tp-rank r --tp-group PREFIX` (argv: rank 0's module and
        flags). NOTE: call from the main thread: a child's death signal follows the thread that started it."""
        self.size, self.name = size, name
        self.prefix = str(Path(run_dir) / f"{name}-{uuid.uuid4().hex[:8]}")
        self.init_method, events_addr = group_paths(self.prefix)
        self.events = ipc.bind_pull(ctx, events_addr)
        self._ctx = ctx
        self._closing = False
        self._ready: dict[int, RankReadyEvent] = {}
        self._socks: list[zmq.Socket] = []
        self._pulls: dict[int, set[int]] = {}  # pull id -> ranks whose copy has not finished
        self._next_pull = 0
        env = {**os.environ, LEADER_ENV: str(os.getpid())}
        self.procs = [
            subprocess.Popen([sys.executable, *argv, "--tp-rank", str(r), "--tp-group", self.prefix], env=env)
            for r in range(1, size)
        ]
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"rank-{rank}", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        """Pids of ranks 1..size-1."""
        return [p.pid for p in self.procs]

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._closing:
            return
        starting = len(self._ready) < self.size - 1
        log.error("%s: TP rank %d (pid %d) exited with code %d; the group goes down", self.name, rank, proc.pid, code)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(STARTUP_ERROR_EXIT if starting and code == STARTUP_ERROR_EXIT else 1)

    def wait_ready(self) -> dict[int, RankReadyEvent]:
        """Block until every other rank is ready (each sends RankReadyEvent once); then connect to them."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(self._ready) < self.size - 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: TP ranks {self._missing()} not ready after {READY_TIMEOUT_S:.0f} s")
            if self.events.poll(1000):
                for msg in ipc.recv_all(self.events):
                    self._on_event(msg)
        for rank in range(1, self.size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # NOTE: never drops nor blocks: a dead rank takes rank 0 down anyway
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(rank_addr(self.prefix, rank))
            self._socks.append(sock)
        return dict(self._ready)

    def _missing(self) -> list[int]:
        return [r for r in range(1, self.size) if r not in self._ready]

    def send(self, msg: Message) -> None:
        """msg to every other rank (queued in order; they run it as soon as they are free)."""
        frame = encode(msg)
        for sock in self._socks:
            sock.send(frame, copy=False)

    def pull(self, prefill_worker: int, src_block_ids: list[int], dst_block_ids: list[int]) -> int:
        """Ask every other rank to pull its KV heads of these blocks; the pull's id (pull_done)."""
        self._next_pull += 1
        self._pulls[self._next_pull] = set(range(1, self.size))
        self.send(RankPullCmd(self._next_pull, prefill_worker, src_block_ids, dst_block_ids))
        return self._next_pull

    def pull_done(self, pull_id: int) -> bool:
        """Whether every other rank's copy of pull_id has finished (forgets it then)."""
        if self._pulls.get(pull_id):
            return False
        self._pulls.pop(pull_id, None)
        return True

    def wait_pull(self, pull_id: int, timeout_s: float) -> bool:
        """Block until pull_done(pull_id) or timeout_s (shutdown paths)."""
        deadline = time.monotonic() + timeout_s
        while not self.pull_done(pull_id):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.events.poll(int(left * 1000) + 1):
                self.handle_events()
        return True

    def handle_events(self) -> None:
        """The other ranks' events waiting on our socket (the worker's poller says when)."""
        for msg in ipc.recv_all(self.events):
            self._on_event(msg)

    def _on_event(self, msg: Message) -> None:
        if isinstance(msg, RankPullDoneEvent):
            for pull_id in msg.pull_ids:
                self._pulls.get(pull_id, set()).discard(msg.tp_rank)
        elif isinstance(msg, RankReadyEvent):
            self._ready[msg.tp_rank] = msg
            log.info("%s: TP rank %d ready (pid %d)", self.name, msg.tp_rank, msg.pid)
        else:
            log.warning("%s: ignored %s from a TP rank", self.name, type(msg).__name__)

    def close(self) -> None:
        """Stop the other ranks (RankStopCmd, then SIGKILL after STOP_TIMEOUT_S) and remove the group's files."""
        self._closing = True
        if self._socks:
            self.send(RankStopCmd())
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()) if self._socks else 0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in [*self._socks, self.events]:
            sock.close(linger=0)
        for path in Path(self.prefix).parent.glob(Path(self.prefix).name + ".*"):
            path.unlink(missing_ok=True)


def die_with_leader() -> None:
    """In a rank > 0: get SIGKILL when rank 0 exits (Linux), and exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    leader = os.environ.get(LEADER_ENV)
    if leader is not None and os.getppid() != int(leader):
        os._exit(1)
