"""Least-loaded worker choice among the workers that are up."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple


class NoWorkerError(RuntimeError):
    """No prefill or no decode worker is up (gRPC UNAVAILABLE)."""


COLOCATED = -1
"""prefill_worker of a request that its decode worker prefills itself (a cluster without prefill workers)."""


class Assignment(NamedTuple):
    prefill_worker: int
    """A prefill worker, or COLOCATED."""
    decode_worker: int


def choose_prefill(up: Iterable[int], num_in_flight: Mapping[int, int]) -> int | None:
    """Fewest requests still at prefill (the router's own count); ties go to the lowest id."""
    return min(up, key=lambda i: (num_in_flight.get(i, 0), i), default=None)


def choose_decode(up: Iterable[int], num_running: Mapping[int, int], num_free_blocks: Mapping[int, int]) -> int | None:
    """Fewest requests assigned (the router's own count), then most free KV blocks (last heartbeat), then
    the lowest id."""
    return min(up, key=lambda j: (num_running.get(j, 0), -num_free_blocks.get(j, 0), j), default=None)


def assign(
    prefill_up: Iterable[int],
    decode_up: Iterable[int],
    num_at_prefill: Mapping[int, int],
    num_at_decode: Mapping[int, int],
    num_free_blocks: Mapping[int, int],
    colocated: bool = False,
) -> Assignment:
    """A prefill and a decode worker for a new request; NoWorkerError when either role has none up.

    colocated: the cluster has no prefill workers; the decode worker prefills too.
    """
    prefill = COLOCATED if colocated else choose_prefill(prefill_up, num_at_prefill)
    decode = choose_decode(decode_up, num_at_decode, num_free_blocks)
    if prefill is None:
        raise NoWorkerError("no prefill worker is up")
    if decode is None:
        raise NoWorkerError("no decode worker is up")
    return Assignment(prefill, decode)
