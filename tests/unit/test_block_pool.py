"""BlockPool and block hashing: exact block ids, LRU eviction order, events, and a model-based check."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.core.block_pool import (
    BLOCK_HASH_SEED,
    NULL_BLOCK_ID,
    ROOT_PARENT_HASH,
    BlockPool,
    NoFreeBlocksError,
    hash_block_tokens,
    hash_full_blocks,
)
from pdserve.core.messages import KV_REMOVED, KV_STORED

REPO_ROOT = Path(__file__).resolve().parents[2]


def assert_counts(pool: BlockPool) -> None:
    assert pool.num_used_blocks + pool.num_free_blocks == pool.num_blocks - 1
    assert len(pool.free_block_ids()) == pool.num_free_blocks


# --- hashing ---------------------------------------------------------------------------------------


def test_hash_matches_documented_byte_layout() -> None:
    import xxhash

    expected = xxhash.xxh3_64_intdigest(struct.pack("<Q3q", 7, 1, -2, 3), seed=BLOCK_HASH_SEED)
    assert hash_block_tokens(7, [1, -2, 3]) == expected
    root = xxhash.xxh3_64_intdigest(struct.pack("<Q2q", ROOT_PARENT_HASH, 5, 6), seed=BLOCK_HASH_SEED)
    assert hash_block_tokens(None, [5, 6]) == root


def test_hash_is_unsigned_64_bit() -> None:
    for tokens in ([], [0], [1, 2, 3, 4], list(range(100))):
        value = hash_block_tokens(None, tokens)
        assert 0 <= value < 2**64


def test_hash_equal_in_fresh_process() -> None:
    code = (
        "from core.block_pool import hash_block_tokens, hash_full_blocks\n"
        "print(hash_block_tokens(None, [1, 2, 3, 4]), hash_block_tokens(99, [5]))\n"
        "print(*hash_full_blocks(list(range(10)), 4))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert [int(x) for x in out[0].split()] == [
        hash_block_tokens(None, [1, 2, 3, 4]),
        hash_block_tokens(99, [5]),
    ]
    assert [int(x) for x in out[1].split()] == hash_full_blocks(list(range(10)), 4)


@pytest.mark.parametrize("parent", [None, 12345])
def test_full_block_hashes_chain_hash_block_tokens(parent: int | None) -> None:
    tokens = [(7 * i) % 50000 for i in range(70)]  # 4 full blocks of 16 and a tail
    chained, h = [], parent
    for i in range(4):
        h = hash_block_tokens(h, tokens[16 * i : 16 * (i + 1)])
        chained.append(h)
    assert hash_full_blocks(tokens, 16, parent) == chained
    assert hash_full_blocks(np.array(tokens, dtype=np.int32), 16, parent) == chained


def test_hash_differs_by_parent_tokens_and_length() -> None:
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4]) == base
    assert hash_block_tokens(1, [1, 2, 3, 4]) != base
    assert hash_block_tokens(None, [1, 2, 3, 5]) != base
    assert hash_block_tokens(None, [4, 3, 2, 1]) != base
    assert hash_block_tokens(None, [1, 2, 3]) != base  # partial tail block
    assert hash_block_tokens(None, [1, 2, 3, 4, 0]) != base


def test_hash_accepts_tuples_and_ranges() -> None:
    assert hash_block_tokens(3, (1, 2)) == hash_block_tokens(3, [1, 2]) == hash_block_tokens(3, range(1, 3))


def test_hash_full_blocks_chains_and_drops_partial_tail() -> None:
    tokens = list(range(11))
    h0 = hash_block_tokens(None, tokens[0:4])
    h1 = hash_block_tokens(h0, tokens[4:8])
    assert hash_full_blocks(tokens, 4) == [h0, h1]
    assert hash_full_blocks(tokens[:3], 4) == []
    assert hash_full_blocks(tokens[4:8], 4, parent_hash=h0) == [h1]


def test_hash_full_blocks_of_an_int64_array_equal_the_lists() -> None:
    tokens = [0, 5, 2**40, 127, 50256, 3, 9, 1, 70000]
    assert hash_full_blocks(np.array(tokens, dtype=np.int64), 4, 11) == hash_full_blocks(tokens, 4, 11)
    assert hash_full_blocks(np.array(tokens, dtype=">i8"), 4) == hash_full_blocks(tokens, 4)  # big-endian input


def test_hash_full_blocks_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError):
        hash_full_blocks([1, 2], 0)


# --- allocation and free order -----------------------------------------------------------------------


def test_fresh_pool_allocates_lowest_ids_never_null() -> None:
    pool = BlockPool(8)
    assert pool.num_free_blocks == 7 and pool.num_used_blocks == 0
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(0) == []
    assert pool.allocate(4) == [4, 5, 6, 7]
    assert NULL_BLOCK_ID not in pool.free_block_ids()
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 7
    assert [pool.ref_cnt(b) for b in range(8)] == [0, 1, 1, 1, 1, 1, 1, 1]
    assert_counts(pool)


def test_pool_needs_null_block_plus_one() -> None:
    with pytest.raises(ValueError):
        BlockPool(1)
    pool = BlockPool(2)
    assert pool.allocate(1) == [1]
    assert pool.num_free_blocks == 0


def test_free_in_reverse_evicts_tail_first() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)  # [1, 2, 3]
    b = pool.allocate(2)  # [4, 5]
    for block_id, block_hash in zip(a, [101, 102, 103], strict=True):
        assert pool.cache_block(block_id, block_hash)
    pool.free(a[::-1])
    pool.free(b[::-1])
    assert pool.free_block_ids() == [6, 7, 3, 2, 1, 5, 4]
    assert pool.num_cached_blocks == 3 and pool.num_free_blocks == 7
    assert pool.match_prefix([101, 102, 103]) == [1, 2, 3]  # cached and free: still findable

    assert pool.allocate(3) == [6, 7, 3]
    assert pool.num_evictions == 1
    assert pool.lookup(103) is None and pool.block_hash(3) is None
    assert pool.lookup(101) == 1 and pool.lookup(102) == 2
    assert pool.match_prefix([101, 102, 103]) == [1, 2]

    assert pool.allocate(3) == [2, 1, 5]
    assert pool.num_evictions == 3
    assert pool.num_cached_blocks == 0
    assert_counts(pool)


def test_touch_free_cached_block_takes_it_off_free_queue() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(2)  # [1, 2]
    pool.cache_block(1, 11)
    pool.cache_block(2, 12)
    pool.free(blocks[::-1])
    assert pool.free_block_ids() == [3, 4, 5, 2, 1]

    hit = pool.match_prefix([11, 12, 13])
    assert hit == [1, 2] and pool.ref_cnt(1) == 0  # match_prefix does not change ref counts
    pool.touch(hit)
    assert [pool.ref_cnt(b) for b in (1, 2)] == [1, 1]
    assert pool.free_block_ids() == [3, 4, 5]
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 2
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.num_evictions == 0 and pool.lookup(11) == 1

    pool.touch([1])  # a second request shares block 1
    assert pool.ref_cnt(1) == 2
    pool.free([1])
    assert pool.ref_cnt(1) == 1 and pool.num_free_blocks == 0
    assert_counts(pool)


def test_touch_rejects_null_and_unknown_blocks_without_change() -> None:
    pool = BlockPool(4)
    pool.allocate(1)
    for bad in ([1, NULL_BLOCK_ID], [1, 4], [1, -1]):
        with pytest.raises(ValueError):
            pool.touch(bad)
        assert pool.ref_cnt(1) == 1


# --- cache_block, lookup, match_prefix --------------------------------------------------------------


def test_match_prefix_stops_at_first_miss() -> None:
    pool = BlockPool(8)
    pool.allocate(4)
    for block_id, block_hash in [(1, 10), (2, 20), (4, 40)]:
        pool.cache_block(block_id, block_hash)
    assert pool.match_prefix([10, 20, 30, 40]) == [1, 2]
    assert pool.match_prefix([30, 10]) == []
    assert pool.match_prefix([]) == []
    assert pool.lookup(40) == 4 and pool.lookup(30) is None


def test_cache_block_duplicate_hash_keeps_first() -> None:
    pool = BlockPool(8)
    pool.allocate(2)
    assert pool.cache_block(1, 77) is True
    assert pool.cache_block(2, 77) is False
    assert pool.lookup(77) == 1 and pool.block_hash(2) is None
    assert pool.cache_block(1, 77) is True  # same block, same hash: no-op
    assert pool.num_cached_blocks == 1
    assert pool.drain_events() == [(KV_STORED, 77)]


def test_cache_block_rejects_second_hash_free_and_null_blocks() -> None:
    pool = BlockPool(8)
    pool.allocate(1)
    pool.cache_block(1, 5)
    with pytest.raises(ValueError):
        pool.cache_block(1, 6)
    with pytest.raises(ValueError):
        pool.cache_block(2, 6)  # free: not held by the caller
    with pytest.raises(ValueError):
        pool.cache_block(NULL_BLOCK_ID, 6)
    assert pool.lookup(6) is None and pool.block_hash(1) == 5


# --- errors -----------------------------------------------------------------------------------------


def test_allocate_too_many_changes_nothing() -> None:
    pool = BlockPool(5)
    pool.allocate(1)
    pool.cache_block(1, 9)
    pool.free([1])
    before = (pool.free_block_ids(), pool.num_cached_blocks, pool.num_evictions)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(5)
    assert (pool.free_block_ids(), pool.num_cached_blocks, pool.num_evictions) == before
    assert pool.num_free_blocks == 4 and pool.lookup(9) == 1
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(6)
    pool.allocate(3)  # [1, 2, 3]
    pool.free([2])
    queue = pool.free_block_ids()
    with pytest.raises(ValueError):
        pool.free([2])
    with pytest.raises(ValueError):
        pool.free([3, 1, 1])  # third entry is a double free: the first two are undone
    assert pool.free_block_ids() == queue
    assert [pool.ref_cnt(b) for b in (1, 2, 3)] == [1, 0, 1]
    assert_counts(pool)


def test_free_null_or_unknown_block_raises() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    for bad in (NULL_BLOCK_ID, 4, -1):
        with pytest.raises(ValueError):
            pool.free([bad])
    assert pool.num_used_blocks == 3


# --- events and reset -------------------------------------------------------------------------------


def test_drain_events_in_order_and_empties() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)  # [1, 2, 3]
    pool.cache_block(1, 100)
    pool.cache_block(2, 200)
    pool.free(blocks[::-1])  # queue: [3, 2, 1]
    pool.allocate(2)  # pops 3 (uncached) and 2 (evicts 200)
    pool.cache_block(3, 300)
    assert pool.drain_events() == [(KV_STORED, 100), (KV_STORED, 200), (KV_REMOVED, 200), (KV_STORED, 300)]
    assert pool.drain_events() == []


def test_event_queue_is_bounded() -> None:
    pool = BlockPool(3, max_pending_events=2)
    pool.allocate(2)
    pool.cache_block(1, 1)
    pool.cache_block(2, 2)
    pool.free([1])
    pool.reset_prefix_cache()
    assert pool.drain_events() == [(KV_STORED, 2), (KV_REMOVED, 1)]
    assert pool.num_dropped_events == 1


def test_evictions_of_one_allocation_past_the_event_bound_count_as_dropped() -> None:
    pool = BlockPool(4, max_pending_events=2)
    blocks = pool.allocate(3)
    for block_id in blocks:
        pool.cache_block(block_id, 10 * block_id)
    assert pool.drain_events() == [(KV_STORED, 20), (KV_STORED, 30)] and pool.num_dropped_events == 1
    pool.free(blocks)  # queue: [1, 2, 3]
    assert pool.allocate(3) == [1, 2, 3] and pool.num_evictions == 3
    assert pool.drain_events() == [(KV_REMOVED, 20), (KV_REMOVED, 30)] and pool.num_dropped_events == 2
    assert pool.num_cached_blocks == 0


def test_reset_prefix_cache_drops_only_free_blocks() -> None:
    pool = BlockPool(6)
    pool.allocate(3)
    for block_id in (1, 2, 3):
        pool.cache_block(block_id, 10 * block_id)
    pool.free([3, 1])
    pool.drain_events()
    assert pool.reset_prefix_cache() == 2
    assert pool.lookup(20) == 2 and pool.lookup(10) is None and pool.lookup(30) is None
    assert pool.drain_events() == [(KV_REMOVED, 10), (KV_REMOVED, 30)]
    assert pool.num_evictions == 0 and pool.num_free_blocks == 4
    assert pool.reset_prefix_cache() == 0


# --- model-based check ------------------------------------------------------------------------------

NUM_BLOCKS = 8
NUM_HASHES = 12
HASHES = st.integers(min_value=0, max_value=NUM_HASHES - 1)


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / touch / free / cache / match sequences against a list-and-dict model."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.ref = [0] * NUM_BLOCKS
        self.free_queue = list(range(1, NUM_BLOCKS))  # LRU order: head is allocated next
        self.cache: dict[int, int] = {}  # hash -> block id
        self.evictions = 0
        self.events: list[tuple[int, int]] = []

    # Each helper calls the pool, checks its answer and updates the model the same way.

    def _drop(self, block_id: int) -> None:
        block_hash = next(h for h, b in self.cache.items() if b == block_id)
        del self.cache[block_hash]
        self.events.append((KV_REMOVED, block_hash))

    def _allocate(self, n: int) -> list[int]:
        got = self.pool.allocate(n)
        expected, self.free_queue = self.free_queue[:n], self.free_queue[n:]
        assert got == expected and all(self.ref[b] == 0 for b in got)
        for block_id in got:
            self.ref[block_id] = 1
            if block_id in self.cache.values():
                self._drop(block_id)
                self.evictions += 1
        return got

    def _touch(self, block_ids: list[int]) -> None:
        self.pool.touch(block_ids)
        for block_id in block_ids:
            if self.ref[block_id] == 0:
                self.free_queue.remove(block_id)
            self.ref[block_id] += 1

    def _free(self, block_ids: list[int]) -> None:
        self.pool.free(block_ids)
        for block_id in block_ids:
            self.ref[block_id] -= 1
            if self.ref[block_id] == 0:
                self.free_queue.append(block_id)

    def _match(self, hashes: list[int]) -> list[int]:
        expected: list[int] = []
        for block_hash in hashes:
            if block_hash not in self.cache:
                break
            expected.append(self.cache[block_hash])
        assert self.pool.match_prefix(hashes) == expected
        return expected

    def _cache(self, block_id: int, block_hash: int) -> None:
        current = self.pool.block_hash(block_id)
        if current is not None and current != block_hash:
            with pytest.raises(ValueError):
                self.pool.cache_block(block_id, block_hash)
            return
        stored = self.pool.cache_block(block_id, block_hash)
        assert stored == (self.cache.get(block_hash, block_id) == block_id)
        if block_hash not in self.cache:
            self.cache[block_hash] = block_id
            self.events.append((KV_STORED, block_hash))

    def _held(self) -> list[int]:
        return [b for b in range(1, NUM_BLOCKS) if self.ref[b] > 0]

    def _hashes(self) -> st.SearchStrategy[int]:
        return st.sampled_from(sorted(self.cache)) | HASHES if self.cache else HASHES

    @rule(data=st.data())
    def run_request(self, data: st.DataObject) -> None:
        """A whole request: reuse the cached prefix, allocate the rest, cache it, free in reverse."""
        hashes = data.draw(st.lists(self._hashes(), max_size=5, unique=True))
        hit = self._match(hashes)
        self._touch(hit)
        num_new = min(len(hashes) - len(hit), len(self.free_queue))
        blocks = hit + self._allocate(num_new)
        for block_id, block_hash in zip(blocks[len(hit) :], hashes[len(hit) :], strict=False):
            self._cache(block_id, block_hash)
        self._free(blocks[::-1])

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        self._allocate(data.draw(st.integers(min_value=0, max_value=len(self.free_queue))))

    @rule()
    def allocate_too_many_rejected(self) -> None:
        with pytest.raises(NoFreeBlocksError):
            self.pool.allocate(len(self.free_queue) + 1)

    @rule(data=st.data())
    def match_and_touch(self, data: st.DataObject) -> None:
        hit = self._match(data.draw(st.lists(self._hashes(), max_size=4)))
        if data.draw(st.booleans()):
            self._touch(hit)

    @precondition(lambda self: any(self.ref))
    @rule(data=st.data())
    def share_held(self, data: st.DataObject) -> None:
        self._touch(data.draw(st.lists(st.sampled_from(self._held()), min_size=1, max_size=3)))

    @precondition(lambda self: any(self.ref))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        held = self._held()
        self._free(data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=4, unique=True)))

    @rule(block_id=st.integers(min_value=0, max_value=NUM_BLOCKS - 1))
    def double_free_rejected(self, block_id: int) -> None:
        if self.ref[block_id] == 0:
            with pytest.raises(ValueError):
                self.pool.free([block_id])

    @precondition(lambda self: any(self.ref))
    @rule(data=st.data(), block_hash=HASHES)
    def cache_block(self, data: st.DataObject, block_hash: int) -> None:
        self._cache(data.draw(st.sampled_from(self._held())), block_hash)

    @rule(reset=st.integers(min_value=0, max_value=3))
    def drain_events_or_reset(self, reset: int) -> None:
        if reset == 3:
            dropped = [b for b in self.cache.values() if self.ref[b] == 0]
            for block_id in dropped:
                self._drop(block_id)
            assert self.pool.reset_prefix_cache() == len(dropped)
        assert self.pool.drain_events() == self.events
        self.events = []

    @invariant()
    def matches_model(self) -> None:
        pool = self.pool
        assert pool.num_used_blocks + pool.num_free_blocks == NUM_BLOCKS - 1
        assert pool.num_free_blocks == len(self.free_queue)
        assert pool.free_block_ids() == self.free_queue
        assert [pool.ref_cnt(b) for b in range(NUM_BLOCKS)] == self.ref
        assert pool.num_evictions == self.evictions
        assert pool.num_cached_blocks == len(self.cache)
        for block_hash in range(NUM_HASHES):
            assert pool.lookup(block_hash) == self.cache.get(block_hash)
        for block_hash, block_id in self.cache.items():
            assert pool.block_hash(block_id) == block_hash


BlockPoolMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_block_pool_matches_model = BlockPoolMachine.TestCase
