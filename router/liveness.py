"""Worker liveness as the router sees it: each expected worker is up from its first heartbeat and down after
`timeout` seconds without one, or restarted when its incarnation changes; a worker whose KV layout differs
from the cluster's never counts as up (router/workers.py acts on the changes). A TP group is one worker: its
rank 0 heartbeats for it and lists its ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from pdserve.core.messages import HeartbeatEvent

Role = Literal["prefill", "decode"]
ChangeKind = Literal["up", "down", "restarted"]

GROUP_LAYOUT_FIELDS = frozenset({"tp_size", "kv_head_ranges"})
"""Fingerprint fields of a worker's TP group: they differ between a prefill and a decode group of other TP sizes,
which may still serve together (the KV handshake between two workers checks what their pools need), so the
router does not compare them."""


@dataclass
class WorkerState:
    """What the router last heard from one worker."""

    role: Role
    worker_id: int
    up: bool = False
    incarnation: str = ""
    last_seen: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    pid: int = 0
    """Rank 0's pid (0 before the first heartbeat)."""
    ranks: list[int] = field(default_factory=list)
    """Pids of the worker's TP group in rank order ([] for TP size 1)."""

    @property
    def tp_size(self) -> int:
        return max(1, len(self.ranks))

    def processes(self) -> str:
        """The worker's processes: "pid 123", or "pid 123 ranks 123,124" for a TP group."""
        ranks = f" ranks {','.join(map(str, self.ranks))}" if len(self.ranks) > 1 else ""
        return f"pid {self.pid}{ranks}"


class LayoutMismatch(ValueError):
    """A worker's KV layout differs from the cluster's: its blocks cannot be handed to or from the others."""


class Change(NamedTuple):
    role: Role
    worker_id: int
    kind: ChangeKind


class Liveness:
    """Up/down state of every expected worker, driven by heartbeats and a clock."""

    def __init__(
        self, num_prefill: int, num_decode: int, timeout: float, expected_layout: dict[str, Any] | None = None
    ) -> None:
        self.timeout = timeout
        self.expected_layout = expected_layout or {}
        """Fields of the KV layout fingerprint the router was configured with (the block size)."""
        self.layout: dict[str, Any] | None = None
        """The cluster's KV layout fingerprint: the first one a worker reported that has the expected fields."""
        self.workers: dict[Role, list[WorkerState]] = {
            "prefill": [WorkerState("prefill", i) for i in range(num_prefill)],
            "decode": [WorkerState("decode", j) for j in range(num_decode)],
        }

    def observe(self, hb: HeartbeatEvent, now: float) -> list[Change]:
        """Record a heartbeat; ValueError for a role or worker id this cluster does not have, and
        LayoutMismatch for a worker whose KV layout differs from the cluster's (it never counts as up)."""
        states = self.workers.get(hb.role)  # type: ignore[call-overload]
        if states is None or not 0 <= hb.worker_id < len(states):
            raise ValueError(f"heartbeat from unknown worker {hb.role!r} {hb.worker_id}")
        st: WorkerState = states[hb.worker_id]
        self._check_layout(hb)
        changes = []
        if not st.up:
            changes.append(Change(st.role, st.worker_id, "up"))
        elif st.incarnation != hb.incarnation:
            changes.append(Change(st.role, st.worker_id, "restarted"))
        st.up, st.incarnation, st.last_seen = True, hb.incarnation, now
        st.num_free_blocks, st.num_total_blocks = hb.num_free_blocks, hb.num_total_blocks
        st.pid, st.ranks = hb.pid, list(hb.ranks)
        return changes

    def _check_layout(self, hb: HeartbeatEvent) -> None:
        """The cluster's layout is the first one heard that has the expected fields (the configured block
        size); every other worker must report the same, but for GROUP_LAYOUT_FIELDS. NOTE: a worker that
        reports none passes."""
        if not isinstance(hb.layout, dict) or not hb.layout:
            return
        reference = self.layout or self.expected_layout
        keys = (set(reference) | (set(hb.layout) if self.layout else set())) - GROUP_LAYOUT_FIELDS
        diffs = [
            f"{k} {reference.get(k)} != {hb.layout.get(k)}"
            for k in sorted(keys)
            if reference.get(k) != hb.layout.get(k)
        ]
        if diffs:
            raise LayoutMismatch(f"{hb.role} worker {hb.worker_id} has another KV layout: " + "; ".join(diffs))
        if self.layout is None:
            self.layout = hb.layout

    def expire(self, now: float) -> list[Change]:
        """Mark down every up worker silent for longer than the timeout."""
        changes = []
        for st in self.all_workers():
            if st.up and now - st.last_seen > self.timeout:
                st.up = False
                changes.append(Change(st.role, st.worker_id, "down"))
        return changes

    def all_workers(self) -> list[WorkerState]:
        return self.workers["prefill"] + self.workers["decode"]

    def up(self, role: Role) -> list[int]:
        return [st.worker_id for st in self.workers[role] if st.up]

    def free_blocks(self, role: Role) -> dict[int, int]:
        return {st.worker_id: st.num_free_blocks for st in self.workers[role]}

    def total_blocks(self, role: Role) -> dict[int, int]:
        return {st.worker_id: st.num_total_blocks for st in self.workers[role]}

    @property
    def serving(self) -> bool:
        """At least one prefill (if the cluster has any) and one decode worker are up."""
        return (not self.workers["prefill"] or bool(self.up("prefill"))) and bool(self.up("decode"))
