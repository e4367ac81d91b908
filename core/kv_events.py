"""Worker side of the router's prefix index: publish the block pool's cache events, answer snapshot requests.

Batches go out on the worker's PUB socket ({role}-{i}.kv.sock), which may lose them (slow joiner, full
queue); each carries a seq, so the router notices a loss at the next batch it gets and asks for a snapshot
(KvSnapshotCmd). The snapshot goes back on the worker's PUSH socket to the router's inbox, which does not
drop messages to a live router.

NOTE: ordering. The two channels are not ordered with each other, so a snapshot says which batch it follows:
snapshot(pool) first publishes whatever the pool recorded, then reports the pool's cached hashes with seq S =
the last seq published, i.e. exactly the state after batches 1..S. The router applies it, then the batches
with seq > S that it buffered or gets later, and ignores those with seq <= S, whichever channel is faster.
NOTE: no torch here: tests drive it with bare block pools.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from pdserve.core import ipc
from pdserve.core.block_pool import BlockEvent, BlockPool
from pdserve.core.messages import KvEventBatchEvent, KvSnapshotEvent, encode


@dataclass(frozen=True)
class KvOrigin:
    """Who publishes: the header of every batch and snapshot."""

    role: str
    """"prefill" or "decode"."""
    worker_id: int
    incarnation: str
    """Random per process start; the router drops what it knew of an older one."""
    block_size: int
    """Tokens per block, so the router hashes prompts the way this worker does."""


def next_seq(seq: int, num_dropped: int) -> int:
    """The seq after seq: +1, or +2 when events were lost since, so that the router sees a gap."""
    return seq + (2 if num_dropped else 1)


def make_batch(origin: KvOrigin, seq: int, events: Sequence[BlockEvent]) -> KvEventBatchEvent:
    """One batch of pool events, oldest first, in wire form."""
    return KvEventBatchEvent(origin.role, origin.worker_id, origin.incarnation, seq, origin.block_size, list(events))


class KvEventPublisher:
    """Drains one block pool's events into numbered batches; builds snapshots that say which batch they follow.

    send delivers a batch: bind() makes one that writes to the PUB socket it owns (sock); tests pass their own.
    """

    def __init__(
        self, origin: KvOrigin, send: Callable[[KvEventBatchEvent], None], sock: zmq.Socket | None = None
    ) -> None:
        self.origin = origin
        self.seq = 0
        """The last seq published (0: none yet)."""
        self.sock = sock
        self._send = send
        self._num_dropped_seen = 0

    @classmethod
    def bind(cls, ctx: zmq.Context, addr: str, origin: KvOrigin) -> KvEventPublisher:
        """A publisher that owns a PUB socket bound to addr."""
        sock = ipc.bind_pub(ctx, addr)

        def send(batch: KvEventBatchEvent) -> None:
            with contextlib.suppress(zmq.Again):  # NOTE: PUB drops at its high-water mark instead; seq tells
                sock.send(encode(batch), flags=zmq.NOBLOCK)

        return cls(origin, send, sock)

    def publish(self, pool: BlockPool) -> KvEventBatchEvent | None:
        """Send the events pool recorded since the last call as one batch; None (nothing sent) if there were none."""
        events = pool.drain_events()
        num_dropped = pool.num_dropped_events - self._num_dropped_seen
        self._num_dropped_seen = pool.num_dropped_events
        if not events and not num_dropped:
            return None
        self.seq = next_seq(self.seq, num_dropped)
        batch = make_batch(self.origin, self.seq, events)
        self._send(batch)
        return batch

    def snapshot(self, pool: BlockPool) -> KvSnapshotEvent:
        """Every hash pool caches, after publishing its pending events (see the module's ordering NOTE)."""
        self.publish(pool)
        o = self.origin
        return KvSnapshotEvent(o.role, o.worker_id, o.incarnation, self.seq, o.block_size, pool.cached_hashes())
