"""The router's copy of every worker's prefix cache, kept from the workers' KV event batches and snapshots.

Per worker (role, worker_id): the set of block hashes its BlockPool caches, the seq of the last batch applied
and whether that copy is in sync. Batches come over PUB/SUB and may be lost; a gap in seq, or an incarnation
whose history the index has not seen from seq 1, puts the worker out of sync: apply() says so, the router
asks the worker for a snapshot (KvSnapshotCmd), and holds the worker's later batches (bounded) until the
snapshot with seq S arrives. It then takes the snapshot's hashes and replays the held batches with
seq > S; those with seq <= S are in the snapshot already (see core/kv_events.py for why this order is
safe whichever channel is faster). Meanwhile match() answers from the last known copy: a hint, not a promise.

Why one flat set of hashes per worker and no radix tree: a block hash is chained on its parent's, so a hash
names its whole prefix; a worker caches the first n blocks of a prompt iff the first n of its hashes are in
its set, exactly as BlockPool.match_prefix walks its own hash -> block map. A tree would store what the
chain already encodes. A set per worker (instead of one hash -> workers map) makes a snapshot or a dead
worker O(1) to swap or drop; match walks each worker's run, O(prompt blocks x workers), and stops at the
first miss.

NOTE: no torch here: the router never imports it (core.block_pool needs only xxhash).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.core.block_pool import hash_block_tokens, hash_full_blocks
from pdserve.core.messages import KV_STORED, KvEventBatchEvent, KvSnapshotEvent, TokenIds

MAX_HELD_EVENTS = 1 << 18
"""Events held per out-of-sync worker until its snapshot; the oldest batches go first (a later gap asks again)."""
NUM_RETIRED_INCARNATIONS = 4
"""Past incarnations remembered per worker, so a late message from a dead process cannot take over again."""


class WorkerKey(NamedTuple):
    role: str
    """"prefill" or "decode"."""
    worker_id: int


def prompt_block_hashes(token_ids: TokenIds, block_size: int) -> list[int]:
    """The hashes a worker's pool caches a prompt's blocks under: one per full block, chained, then the partial
    tail's (hash_block_tokens chained on the last full block's hash) if len(token_ids) % block_size != 0.

    Mirrors KVCacheManager._extend_hashes and _final_hash, so match() over this list counts what the worker's
    match_prefix would find, a cached whole-prompt tail included.
    """
    hashes = hash_full_blocks(token_ids, block_size)
    tail = token_ids[len(hashes) * block_size :]
    if len(tail):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tail))
    return hashes


@dataclass
class _WorkerCopy:
    """What the index knows of one incarnation of one worker."""

    incarnation: str
    block_size: int
    hashes: set[int] = field(default_factory=set)
    seq: int = 0
    """The last batch applied (or the snapshot's seq)."""
    synced: bool = False
    """hashes is the worker's cache after batch seq; False while a snapshot is awaited."""
    held: deque[KvEventBatchEvent] = field(default_factory=deque)
    """Batches that arrived while out of sync, oldest first."""
    num_held_events: int = 0


class PrefixIndex:
    """Block hash sets of every worker, with the seq bookkeeping that tells when one must be resynced.

    NOTE: event-loop thread only. match() reports every worker it holds a copy of, up or not: callers filter
    by liveness (the router drops a worker here when it goes down, but a late message may bring it back).
    """

    def __init__(self) -> None:
        self._workers: dict[WorkerKey, _WorkerCopy] = {}
        self._retired: dict[WorkerKey, deque[str]] = {}

    # --- updates --------------------------------------------------------------------------------------
    def apply(self, batch: KvEventBatchEvent) -> bool:
        """Apply one batch, or hold it while the worker is out of sync; False when the worker must be asked for
        a snapshot (a gap in seq, or a new incarnation first heard after its batch 1). A message from a retired
        incarnation is ignored (True)."""
        w = self._copy_for(batch.role, batch.worker_id, batch.incarnation, batch.block_size)
        if w is None:
            return True
        if not w.synced:
            _hold(w, batch)
            if batch.seq == 1:  # NOTE: an incarnation's pool starts empty: batch 1 begins its whole history
                _sync(w, 0, ())
            return w.synced
        if batch.seq <= w.seq:
            return True  # NOTE: already part of the snapshot applied
        if batch.seq == w.seq + 1:
            _apply_events(w.hashes, batch.events)
            w.seq = batch.seq
            return True
        w.synced = False  # a gap: hashes stay as the best guess until the snapshot
        _hold(w, batch)
        return False

    def apply_snapshot(self, snap: KvSnapshotEvent) -> bool:
        """Take a worker's snapshot and replay its held batches after snap.seq; False when they still have a gap
        (ask again). A snapshot older than the copy in sync, or from a retired incarnation, is ignored (True)."""
        w = self._copy_for(snap.role, snap.worker_id, snap.incarnation, snap.block_size)
        if w is None or (w.synced and snap.seq <= w.seq):
            return True
        _sync(w, snap.seq, snap.hashes)
        return w.synced

    def remove_worker(self, key: WorkerKey) -> None:
        """Forget a worker that went down or restarted; it is resynced from its next snapshot."""
        self._workers.pop(key, None)

    def _copy_for(self, role: str, worker_id: int, incarnation: str, block_size: int) -> _WorkerCopy | None:
        """The copy of this incarnation; a new incarnation replaces (and retires) the one held; None if retired."""
        key = WorkerKey(role, worker_id)
        w = self._workers.get(key)
        if w is not None and w.incarnation == incarnation:
            return w
        retired = self._retired.setdefault(key, deque(maxlen=NUM_RETIRED_INCARNATIONS))
        if incarnation in retired:
            return None
        if w is not None:
            retired.append(w.incarnation)
        w = self._workers[key] = _WorkerCopy(incarnation, block_size)
        return w

    # --- queries --------------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[int], role: str) -> dict[int, int]:
        """worker_id -> how many of block_hashes, from the start, that worker caches (its match_prefix length),
        for every worker of role the index holds."""
        matched = {}
        for key, w in self._workers.items():
            if key.role != role:
                continue
            n, hashes = 0, w.hashes
            for block_hash in block_hashes:
                if block_hash not in hashes:
                    break
                n += 1
            matched[key.worker_id] = n
        return matched

    def block_size(self, role: str) -> int | None:
        """The block size role's workers hash with (prompt_block_hashes needs it); None if unknown or mixed."""
        sizes = {w.block_size for key, w in self._workers.items() if key.role == role}
        return sizes.pop() if len(sizes) == 1 else None

    def synced_seq(self, key: WorkerKey) -> int | None:
        """The seq the copy of key is in sync at; None while out of sync or unknown."""
        w = self._workers.get(key)
        return w.seq if w is not None and w.synced else None

    def hashes_of(self, key: WorkerKey) -> frozenset[int]:
        """The hashes held for key (empty if unknown)."""
        w = self._workers.get(key)
        return frozenset(w.hashes) if w is not None else frozenset()


def _apply_events(hashes: set[int], events: Iterable[tuple[int, int]]) -> None:
    for kind, block_hash in events:
        if kind == KV_STORED:
            hashes.add(block_hash)
        else:
            hashes.discard(block_hash)


def _hold(w: _WorkerCopy, batch: KvEventBatchEvent) -> None:
    w.held.append(batch)
    w.num_held_events += 1 + len(batch.events)
    while w.num_held_events > MAX_HELD_EVENTS and len(w.held) > 1:
        w.num_held_events -= 1 + len(w.held.popleft().events)


def _sync(w: _WorkerCopy, seq: int, hashes: Iterable[int]) -> None:
    """Take the worker's state after batch seq, then replay the held batches after it up to the first gap."""
    w.hashes, w.seq, w.synced = set(hashes), seq, True
    held = sorted(w.held, key=lambda b: b.seq)
    w.held.clear()
    w.num_held_events = 0
    for i, batch in enumerate(held):
        if batch.seq <= w.seq:
            continue
        if batch.seq != w.seq + 1:
            w.synced = False
            for later in held[i:]:
                _hold(w, later)
            return
        _apply_events(w.hashes, batch.events)
        w.seq = batch.seq
