"""Admission control: a request enters the workers only when a decode worker has KV room for all of it
(prompt + max_tokens, in blocks, reserved against that worker's pool until the request ends); the rest wait
in one FIFO queue of bounded length, and a request that finds the queue full is refused (RESOURCE_EXHAUSTED).

So an overload of any size costs the router memory for at most max_queued waiting requests, the workers
never hold more than their KV can finish, and every admitted request completes without preemption.
NOTE: reserving max_tokens is conservative when most requests stop early (EOS); a request larger than a
whole pool reserves the pool and runs alone.
"""

from __future__ import annotations

import asyncio
from collections import deque


class QueueFullError(RuntimeError):
    """The admission queue is full (gRPC RESOURCE_EXHAUSTED)."""


class NoRoomError(RuntimeError):
    """Decode workers are up but none has KV room for the request now (it waits in the queue)."""


def blocks_needed(num_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a request of num_tokens input tokens holds at its longest."""
    return -(-(num_tokens + max_tokens) // block_size)


class AdmissionQueue:
    """FIFO of requests waiting for KV room. A waiter is woken (notify) when room may have appeared; it
    tries again and, finding none, waits at the head again. NOTE: event-loop thread only."""

    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self.waiters: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self.waiters)

    async def wait_turn(self, at_head: bool = False) -> None:
        """Until notified; QueueFullError when max_queued wait already (a returning head always fits)."""
        if not at_head and len(self.waiters) >= self.max_queued:
            raise QueueFullError(f"{len(self.waiters)} requests are waiting for KV room; try again later")
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if at_head:
            self.waiters.appendleft(turn)
        else:
            self.waiters.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn in self.waiters:
                self.waiters.remove(turn)
            elif turn.done() and not turn.cancelled():
                self.notify()  # NOTE: it was woken and then cancelled: the wake-up goes to the next one
            raise

    def notify(self) -> None:
        """Wake the longest waiter (room may have appeared)."""
        while self.waiters:
            turn = self.waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
