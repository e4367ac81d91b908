"""The busy-poll window every pdserve process uses after work (workers: core/worker_base.py; the router:
router/busy_poll.py). NOTE: no torch here: the router and the supervisor import it."""

from __future__ import annotations

CUDA_BUSY_POLL_S = 1.0
"""Default window of a cluster on CUDA: a GPU host has cores to spare. CPU clusters default to none (their
cores run the model)."""


def busy_poll_seconds(busy_poll_ms: float | None, device: str) -> float:
    """--busy-poll-ms in seconds; unset: CUDA_BUSY_POLL_S on CUDA, none on CPU."""
    if busy_poll_ms is not None:
        return max(busy_poll_ms, 0.0) / 1e3
    return CUDA_BUSY_POLL_S if device.startswith("cuda") else 0.0
