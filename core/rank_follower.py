"""A rank > 0 of a worker's TP group: it holds its shard of the model and of the KV pool and runs, in order,
whatever rank 0 sends (core/rank_group.py); it has no scheduler, no requests and no socket to anyone else.

The roles add what their ranks do beyond passes: a prefill rank exports its pool (prefill_worker/rank.py), a
decode rank opens prefill pools and pulls its KV heads of handed-off blocks (decode_worker/rank.py).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from pdserve.core import ipc
from pdserve.core.messages import (
    Message,
    RankDecodeCmd,
    RankPassCmd,
    RankReadyEvent,
    RankStopCmd,
)
from pdserve.core.model_runner import ModelRunner
from pdserve.core.parallel import close_tp_group
from pdserve.core.rank_group import group_paths, rank_addr

log = logging.getLogger(__name__)


class RankFollower:
    """The loop of a rank > 0; subclasses build self.runner (and their KV transfer pieces) in __init__."""

    def __init__(self, rank: int, prefix: str, busy_poll_s: float) -> None:
        self.rank = rank
        self.busy_poll_s = busy_poll_s
        """After a command the loop polls without sleeping this long (the step's other ranks wait on us)."""
        self.ctx = zmq.Context()
        self.commands = ipc.bind_pull(self.ctx, rank_addr(prefix, rank))
        self.to_leader = ipc.connect_push(self.ctx, group_paths(prefix)[1])
        self.runner: ModelRunner  # set by the subclass

    def descriptors(self) -> dict[str, Any]:
        """What rank 0 learns in our ready event (a prefill rank: its pool's descriptors)."""
        return {}

    def handle(self, msg: Message) -> None:
        """Commands beyond passes and stop (subclasses)."""
        log.warning("TP rank %d ignores %s", self.rank, type(msg).__name__)

    def after_commands(self) -> None:
        """Per-iteration housekeeping (a decode rank reports finished pulls)."""

    def has_pending_work(self) -> bool:
        return False

    def run(self) -> int:
        """Serve rank 0 until RankStopCmd (rank 0's death kills this process: rank_group.die_with_leader)."""
        ipc.send(self.to_leader, RankReadyEvent(self.rank, os.getpid(), self.descriptors()), wait_ms=10_000)
        log.info("TP rank %d ready (pid %d)", self.rank, os.getpid())
        last_work = time.monotonic()
        try:
            while True:
                if self.commands.poll(self._poll_ms(last_work)):
                    last_work = time.monotonic()
                    for msg in ipc.recv_all(self.commands):
                        if isinstance(msg, RankStopCmd):
                            return 0
                        if isinstance(msg, (RankPassCmd, RankDecodeCmd)):
                            self.runner.replay(msg)
                        else:
                            self.handle(msg)
                self.after_commands()
        finally:
            self.close()

    def _poll_ms(self, last_work: float) -> int:
        if time.monotonic() - last_work < self.busy_poll_s:
            return 0
        return 1 if self.has_pending_work() else -1

    def close(self) -> None:
        close_tp_group()
        self.ctx.destroy(linger=100)
