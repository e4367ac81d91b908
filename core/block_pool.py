"""Refcounted KV block pool with prefix caching: it hands out block ids and never touches tensors.

Block lifecycle: allocate (ref_cnt 1) -> cache_block (registered under its chained hash) -> touch by
other requests that hit the cache -> free (ref_cnt 0: appended to the LRU free queue, still findable
by hash) -> allocate pops it from the queue head and drops its hash (lazy eviction).
"""

from __future__ import annotations

import sys
from array import array
from collections import deque
from collections.abc import Sequence

import numpy as np
import xxhash

from pdserve.core.messages import KV_REMOVED, KV_STORED

NULL_BLOCK_ID = 0
"""Padding block: never allocated, never freed, never cached."""

BLOCK_HASH_SEED = 0x7064_7365_7276_65  # b"pdserve"
"""xxh3_64 seed of every block hash; changing it invalidates every stored hash."""

ROOT_PARENT_HASH = 0x9E37_79B9_7F4A_7C15
"""Stands in for the parent hash of a sequence's first block."""

MAX_PENDING_EVENTS = 100_000
"""Events kept between drains; older ones are dropped so an unread pool stays bounded."""

_SWAP_BYTES = sys.byteorder != "little"


class NoFreeBlocksError(RuntimeError):
    """allocate asked for more blocks than are free; the pool is unchanged."""


BlockEvent = tuple[int, int]
"""(KV_STORED, hash): a block was registered under hash; (KV_REMOVED, hash): hash left the prefix cache (its
block was reused or the cache was reset). The wire form of KvEventBatchEvent.events, kept as is.

Plain tuples, not dataclasses: a long prompt on a full cache makes hundreds of events before and after its
pass, on the host path."""


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int64 bytes."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.astype("<i8", copy=False).tobytes()
    packed = array("q", token_ids)
    if _SWAP_BYTES:
        packed.byteswap()
    return packed.tobytes()


def _hash_bytes(parent_hash: int | None, payload: bytes | memoryview) -> int:
    parent = ROOT_PARENT_HASH if parent_hash is None else parent_hash
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + payload, seed=BLOCK_HASH_SEED)


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int] | np.ndarray) -> int:
    """Chained hash of one block: xxh3_64(seed=BLOCK_HASH_SEED) over the parent hash as 8 bytes
    little-endian (ROOT_PARENT_HASH when None) followed by the tokens as little-endian int64.

    Deterministic across processes and runs; an unsigned 64-bit int. A partial tail block hashes
    differently from any full block because its bytes are shorter.
    """
    return _hash_bytes(parent_hash, _token_bytes(token_ids))


def hash_full_blocks(
    token_ids: Sequence[int] | np.ndarray, block_size: int, parent_hash: int | None = None
) -> list[int]:
    """Hashes of the len(token_ids) // block_size full blocks, each chained on the previous one."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full = len(token_ids) // block_size
    payload = _token_bytes(token_ids[: num_full * block_size])
    stride = 8 * block_size
    parent = ROOT_PARENT_HASH if parent_hash is None else parent_hash
    digest, hashes = xxhash.xxh3_64_intdigest, []
    # NOTE: _hash_bytes inlined (the same hashes): every prompt pays this twice (router routing, worker lookup)
    for start in range(0, num_full * stride, stride):
        parent = digest(parent.to_bytes(8, "little") + payload[start : start + stride], seed=BLOCK_HASH_SEED)
        hashes.append(parent)
    return hashes


class BlockPool:
    """Ref counts, an LRU free queue and a hash -> block map over block ids 1..num_blocks-1.

    NOTE: a block is in the free queue iff its ref_cnt is 0 (the null block is in neither).
    NOTE: a block with a hash is never written again by callers; it may only be read or freed.
    """

    def __init__(self, num_blocks: int, max_pending_events: int = MAX_PENDING_EVENTS) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_evictions = 0
        self.num_dropped_events = 0
        """Events lost to the bounded queue since the pool was made (a reader that saw it grow missed some)."""
        self._ref_cnts = [0] * num_blocks
        self._block_of_hash: dict[int, int] = {}
        self._hash_of_block: dict[int, int] = {}
        self._events: deque[BlockEvent] = deque(maxlen=max_pending_events)
        self._init_free_queue()

    def _init_free_queue(self) -> None:
        # Doubly linked list over ids; index num_blocks is the sentinel (head/tail), 0 stays unlinked.
        n = self.num_blocks
        self._sentinel = n
        self._next = [-1] + list(range(2, n + 1)) + [1]
        self._prev = [-1, n] + list(range(1, n))
        self._num_free = n - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached or not."""
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref_cnt > 0; num_used_blocks + num_free_blocks == num_blocks - 1."""
        return self.num_blocks - 1 - self._num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash, used or free."""
        return len(self._block_of_hash)

    def allocate(self, n: int) -> list[int]:
        """Pop n blocks from the head of the free queue with ref_cnt 1, dropping any hash they held.

        Raises NoFreeBlocksError, changing nothing, when n > num_free_blocks.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self._num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self._num_free} free")
        # NOTE: the first n of the free queue are cut off in one relink, not unlinked one by one
        nxt, refs, hashed = self._next, self._ref_cnts, self._hash_of_block
        block_ids = [0] * n
        block_id = nxt[self._sentinel]
        for i in range(n):
            block_ids[i] = block_id
            refs[block_id] = 1
            block_id = nxt[block_id]
        nxt[self._sentinel] = block_id
        self._prev[block_id] = self._sentinel
        self._num_free -= n
        if hashed:
            self.num_evictions += self._drop_hashes(block_ids)
        return block_ids

    def touch(self, block_ids: Sequence[int]) -> None:
        """ref_cnt += 1 for each block; a free block (a cache hit) leaves the free queue."""
        if block_ids and not (min(block_ids) > NULL_BLOCK_ID and max(block_ids) < self.num_blocks):
            for block_id in block_ids:
                self._check_id(block_id)
        # NOTE: the hot path of every cache hit: the queue's unlink inlined, locals for the lists
        ref_cnts, prev, nxt = self._ref_cnts, self._prev, self._next
        unlinked = 0
        for block_id in block_ids:
            if ref_cnts[block_id] == 0:
                prev_id, next_id = prev[block_id], nxt[block_id]
                nxt[prev_id] = next_id
                prev[next_id] = prev_id
                unlinked += 1
            ref_cnts[block_id] += 1
        self._num_free -= unlinked

    def free(self, block_ids: Sequence[int]) -> None:
        """ref_cnt -= 1 for each block in order; one reaching 0 goes to the tail of the free queue.

        Pass a request's blocks in reverse so its tail is evicted first. Raises ValueError, changing
        nothing, on the null block, an unknown id or a block already at ref_cnt 0 (double free).

        Ids are checked once (min, max) and the freed run is linked as a chain behind the old tail: every finished
        request frees its blocks here."""
        if not block_ids:
            return
        if not (min(block_ids) > NULL_BLOCK_ID and max(block_ids) < self.num_blocks):
            bad = next(b for b in block_ids if not NULL_BLOCK_ID < b < self.num_blocks)
            raise ValueError(f"cannot free block {bad}: null, unknown or not allocated")
        ref_cnts, prev, nxt, sentinel = self._ref_cnts, self._prev, self._next, self._sentinel
        last = prev[sentinel]
        freed = 0
        for i, block_id in enumerate(block_ids):
            count = ref_cnts[block_id] - 1
            if count > 0:
                ref_cnts[block_id] = count
            elif count == 0:  # to the tail of the free queue
                ref_cnts[block_id] = 0
                nxt[last] = block_id
                prev[block_id] = last
                last = block_id
                freed += 1
            else:
                nxt[last], prev[sentinel] = sentinel, last
                self._num_free += freed
                self.touch(block_ids[:i])  # NOTE: exact undo of the frees done so far
                raise ValueError(f"cannot free block {block_id}: null, unknown or not allocated")
        nxt[last], prev[sentinel] = sentinel, last
        self._num_free += freed

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a held block under block_hash; True if it is (now) the block cached for it.

        Returns False, keeping the existing entry, when another block already has this hash.
        Raises ValueError if the block is not held or already holds a different hash.
        """
        self.cache_blocks((block_id,), (block_hash,))
        return self._hash_of_block.get(block_id) == block_hash

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[int]) -> None:
        """cache_block for each pair in order (pairs before a ValueError stay registered).

        One loop with locals, no per-block call: a long prompt registers hundreds of blocks on the host path."""
        if block_ids and not (min(block_ids) > NULL_BLOCK_ID and max(block_ids) < self.num_blocks):
            for block_id in block_ids:
                self._check_id(block_id)
        hash_of_block, block_of_hash, refs = self._hash_of_block, self._block_of_hash, self._ref_cnts
        stored: list[BlockEvent] = []
        try:
            for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
                current = hash_of_block.get(block_id)
                if current == block_hash:
                    continue
                if current is not None:
                    raise ValueError(f"block {block_id} already cached under another hash")
                if refs[block_id] == 0:
                    raise ValueError(f"block {block_id} is free; only a held block can be cached")
                if block_hash not in block_of_hash:
                    block_of_hash[block_hash] = block_id
                    hash_of_block[block_id] = block_hash
                    stored.append((KV_STORED, block_hash))
        finally:
            self._record_all(stored)

    def lookup(self, block_hash: int) -> int | None:
        """The block cached under block_hash, or None."""
        return self._block_of_hash.get(block_hash)

    def match_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest cached run from the start of block_hashes; ref counts unchanged."""
        block_ids: list[int] = []
        for block_hash in block_hashes:
            block_id = self._block_of_hash.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def ref_cnt(self, block_id: int) -> int:
        """Current reference count (0 for the null block)."""
        self._check_id(block_id, allow_null=True)
        return self._ref_cnts[block_id]

    def num_unheld(self, block_ids: Sequence[int]) -> int:
        """How many of block_ids are at ref_cnt 0 (ids must be valid: taken from this pool)."""
        ref_cnts = self._ref_cnts
        return sum(1 for b in block_ids if ref_cnts[b] == 0)

    def block_hash(self, block_id: int) -> int | None:
        """The hash a block is cached under, or None."""
        self._check_id(block_id, allow_null=True)
        return self._hash_of_block.get(block_id)

    def drain_events(self) -> list[BlockEvent]:
        """(kind, hash) events (BlockEvent) since the last drain, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events

    def cached_hashes(self) -> list[int]:
        """Every hash in the prefix cache (held or free blocks), in no particular order."""
        return list(self._block_of_hash)

    def reset_prefix_cache(self) -> int:
        """Drop the hashes of all free cached blocks (held ones keep theirs); returns how many."""
        return self._drop_hashes([b for b in self._hash_of_block if self._ref_cnts[b] == 0])

    def free_block_ids(self) -> list[int]:
        """The free queue from head (next to allocate) to tail; O(num_free), for tests and debugging."""
        block_ids: list[int] = []
        block_id = self._next[self._sentinel]
        while block_id != self._sentinel:
            block_ids.append(block_id)
            block_id = self._next[block_id]
        return block_ids

    def _check_id(self, block_id: int, allow_null: bool = False) -> None:
        lowest = NULL_BLOCK_ID if allow_null else NULL_BLOCK_ID + 1
        if not lowest <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is the null block or out of range")

    def _drop_hashes(self, block_ids: Sequence[int]) -> int:
        """Drop the hashes the blocks hold (blocks without one are skipped); how many were dropped.

        One loop with locals, no per-block call or event object: on a full cache every allocated block evicts
        one."""
        hash_of_block, block_of_hash, removed = self._hash_of_block, self._block_of_hash, []
        for block_id in block_ids:
            block_hash = hash_of_block.pop(block_id, None)
            if block_hash is not None:
                del block_of_hash[block_hash]
                removed.append((KV_REMOVED, block_hash))
        self._record_all(removed)
        return len(removed)

    def _record_all(self, events: Sequence[BlockEvent]) -> None:
        """Append events, oldest first; the bounded deque drops as many of its oldest as overflow."""
        events_q = self._events
        assert events_q.maxlen is not None
        self.num_dropped_events += max(0, len(events_q) + len(events) - events_q.maxlen)
        events_q.extend(events)
