"""Leases: the prefill side's record of which blocks a decode worker may still read, and until when.

The scheduler-side half of the connector. A handed-off request's blocks stay referenced under a lease
until the decode worker releases it (ReleaseCmd), it expires, or the decode worker is declared lost.
Every way out returns the lease's block ids exactly once; the prefill worker frees them into its block
pool (this table never touches the pool or any tensor).

NOTE: block ids are returned once per lease that holds them: two leases over a shared prefix block give
that id twice, matching the two references the engine holds.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    """Blocks lent to one decode worker for one request."""

    lease_id: int
    request_id: str
    decode_worker: int
    block_ids: tuple[int, ...]
    deadline: float
    """Expires when the clock reaches this value (same clock as grant's now)."""


class LeaseTable:
    """Live leases by id, plus a deadline heap so that expire() costs O(1) when nothing is due."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, lease_id); released ids linger
        self._next_id = 1
        self._num_leased_blocks = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    @property
    def num_leased_blocks(self) -> int:
        """Block references held by live leases."""
        return self._num_leased_blocks

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def grant(self, request_id: str, decode_worker: int, block_ids: list[int], now: float, ttl: float) -> int:
        """Lease block_ids to decode_worker until now + ttl; returns the new lease id (1, 2, 3, ...)."""
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        lease = Lease(self._next_id, request_id, decode_worker, tuple(block_ids), now + ttl)
        self._next_id += 1
        self._leases[lease.lease_id] = lease
        self._num_leased_blocks += len(lease.block_ids)
        heapq.heappush(self._deadlines, (lease.deadline, lease.lease_id))
        return lease.lease_id

    def release(self, lease_ids: list[int]) -> list[int]:
        """End these leases; their block ids in the order given. Unknown or ended ids are ignored."""
        return self._end(lease_ids)

    def expire(self, now: float) -> list[int]:
        """End every lease whose deadline is <= now; their block ids, earliest deadline first."""
        due: list[int] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            if lease_id in self._leases:
                due.append(lease_id)
        return self._end(due)

    def reclaim(self, decode_worker: int) -> list[int]:
        """End every lease of decode_worker (it died); their block ids in grant order."""
        return self._end([lid for lid, lease in self._leases.items() if lease.decode_worker == decode_worker])

    def _end(self, lease_ids: Iterable[int]) -> list[int]:
        blocks: list[int] = []
        for lease_id in lease_ids:
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                blocks.extend(lease.block_ids)
                self._num_leased_blocks -= len(lease.block_ids)
        return blocks
