"""router.prefix_index: the router's copy of each worker's prefix cache equals the worker's real BlockPool
whenever it is in sync, under lossy batch delivery, delayed snapshots, evictions, restarts and overflows."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from pdserve.core.block_pool import BlockPool
from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.core.kv_events import KvEventPublisher, KvOrigin
from pdserve.core.messages import KvEventBatchEvent, KvSnapshotEvent, decode, encode
from pdserve.core.request import Request
from pdserve.core.sampler import SamplingState
from pdserve.core.sampling_params import SamplingParams
from pdserve.router import prefix_index
from pdserve.router.prefix_index import PrefixIndex, WorkerKey, prompt_block_hashes

BLOCK_SIZE = 4
STEMS = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]
"""Shared prefixes, so that prompts hit each other's blocks."""


def random_prompt(rng: random.Random) -> list[int]:
    stem = rng.choice(STEMS)
    return stem + [rng.randrange(3) for _ in range(rng.randrange(0 if stem else 1, 9))]


# --- a worker: a real BlockPool driven the way KVCacheManager drives it, publishing real batches ------


@dataclass
class SimWorker:
    key: WorkerKey
    incarnation: str
    num_blocks: int = 12
    max_pending_events: int = 10_000
    sent: list[KvEventBatchEvent] = field(default_factory=list)
    running: list[list[int]] = field(default_factory=list)
    """Block lists of the requests holding blocks."""

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, self.max_pending_events)
        origin = KvOrigin(self.key.role, self.key.worker_id, self.incarnation, BLOCK_SIZE)
        self.publisher = KvEventPublisher(origin, self.sent.append)

    def admit(self, tokens: list[int]) -> None:
        """Share the cached run, allocate the rest (evicting), cache every new block (the tail too)."""
        pool, hashes = self.pool, prompt_block_hashes(tokens, BLOCK_SIZE)
        matched = pool.match_prefix(hashes)
        num_new = len(hashes) - len(matched)
        if num_new > pool.num_free_blocks - sum(1 for b in matched if pool.ref_cnt(b) == 0):
            return
        pool.touch(matched)
        new = pool.allocate(num_new)
        for block_id, block_hash in zip(new, hashes[len(matched) :], strict=True):
            pool.cache_block(block_id, block_hash)
        self.running.append(matched + new)

    def finish(self, rng: random.Random) -> None:
        if self.running:
            self.pool.free(self.running.pop(rng.randrange(len(self.running)))[::-1])

    def step(self, rng: random.Random) -> None:
        for _ in range(rng.randrange(1, 4)):
            r = rng.random()
            if r < 0.55:
                self.admit(random_prompt(rng))
            elif r < 0.97:
                self.finish(rng)
            else:
                self.pool.reset_prefix_cache()

    def take_sent(self) -> list[KvEventBatchEvent]:
        sent = list(self.sent)
        self.sent.clear()  # NOTE: in place: the publisher appends to this list
        return sent


def wire(msg: KvEventBatchEvent | KvSnapshotEvent) -> KvEventBatchEvent | KvSnapshotEvent:
    out = decode(encode(msg))
    assert out == msg
    return out  # type: ignore[return-value]


def assert_in_sync(index: PrefixIndex, w: SimWorker, queries: list[list[int]]) -> None:
    assert index.hashes_of(w.key) == set(w.pool.cached_hashes())
    for tokens in queries:
        hashes = prompt_block_hashes(tokens, BLOCK_SIZE)
        assert index.match(hashes, w.key.role)[w.key.worker_id] == len(w.pool.match_prefix(hashes))


# --- the resync protocol, as the router's WorkerHub runs it -----------------------------------------


@dataclass
class Net:
    """Batches: in order, each lost with probability loss. Snapshots: reliable, after random delays."""

    index: PrefixIndex
    rng: random.Random
    loss: float
    asked: dict[WorkerKey, int] = field(default_factory=dict)
    """Worker -> steps until it takes the snapshot it was asked for."""
    in_flight: list[tuple[int, KvSnapshotEvent]] = field(default_factory=list)
    num_lost: int = 0
    num_snapshots: int = 0

    def ask(self, key: WorkerKey) -> None:
        self.asked.setdefault(key, self.rng.randrange(3))

    def step(self, workers: list[SimWorker]) -> None:
        for w in workers:  # a worker answers KvSnapshotCmd in its loop: publishes, then snapshots
            due = self.asked.get(w.key)
            if due is not None:
                if due == 0:
                    del self.asked[w.key]
                    self.in_flight.append((self.rng.randrange(3), w.publisher.snapshot(w.pool)))
                else:
                    self.asked[w.key] = due - 1
        for w in workers:
            for batch in w.take_sent():
                if self.rng.random() < self.loss:
                    self.num_lost += 1
                elif not self.index.apply(wire(batch)):  # type: ignore[arg-type]
                    self.ask(w.key)
        self._deliver_snapshots()
        for w in workers:  # the hub's retry timer: anyone out of sync and not asked is asked
            if self.index.synced_seq(w.key) is None and w.key not in self.asked:
                self.ask(w.key)

    def _deliver_snapshots(self) -> None:
        later = []
        for delay, snap in self.in_flight:
            if delay > 0:
                later.append((delay - 1, snap))
                continue
            self.num_snapshots += 1
            if not self.index.apply_snapshot(wire(snap)):  # type: ignore[arg-type]
                self.ask(WorkerKey(snap.role, snap.worker_id))
        self.in_flight = later


def settle(net: Net, workers: list[SimWorker], rng: random.Random) -> None:
    """Lossless delivery until every worker is in sync at its last seq. A dropped last batch is only noticed
    at the next one, so each worker first publishes one more event (a prompt of a token nobody else uses)."""
    net.loss = 0.0
    for w in workers:
        while w.running:
            w.finish(rng)
        w.admit([1000 + rng.randrange(1000)])
        w.publisher.publish(w.pool)
    for _ in range(20):
        net.step(workers)
        if all(net.index.synced_seq(w.key) == w.publisher.seq for w in workers) and not net.in_flight:
            return
    raise AssertionError("the index did not get back in sync")


@pytest.mark.parametrize("seed", range(4))
def test_index_equals_every_pool_whenever_in_sync_under_lossy_delivery(seed: int) -> None:
    rng = random.Random(seed)
    index = PrefixIndex()
    workers = [
        SimWorker(WorkerKey("prefill", 0), "p0"),
        SimWorker(WorkerKey("prefill", 1), "p1", num_blocks=9),
        SimWorker(WorkerKey("decode", 0), "d0", max_pending_events=6),  # overflows now and then
    ]
    net = Net(index, rng, loss=0.2)
    num_checked = 0
    for _ in range(400):
        for w in workers:
            w.step(rng)
            w.publisher.publish(w.pool)
        net.step(workers)
        queries = [random_prompt(rng) for _ in range(8)]
        for w in workers:
            if index.synced_seq(w.key) == w.publisher.seq:
                assert_in_sync(index, w, queries)
                num_checked += 1
    settle(net, workers, rng)
    for w in workers:
        assert_in_sync(index, w, [random_prompt(rng) for _ in range(50)])
    assert num_checked > 600  # in sync most of the time, not only at the end
    assert net.num_lost > 100 and net.num_snapshots > 100
    assert all(w.pool.num_evictions > 200 for w in workers) and workers[2].pool.num_dropped_events > 50
    assert set(index.match([], "decode")) == {0} and set(index.match([], "prefill")) == {0, 1}


# --- single behaviours ------------------------------------------------------------------------------


def synced_worker(index: PrefixIndex, incarnation: str = "a") -> SimWorker:
    w = SimWorker(WorkerKey("prefill", 0), incarnation)
    w.admit([1, 2, 3, 4, 5, 6, 7, 8, 9])
    w.publisher.publish(w.pool)
    (batch,) = w.take_sent()
    assert batch.seq == 1 and index.apply(batch)  # batch 1 is a whole history: in sync without a snapshot
    return w


def test_prompt_hashes_are_the_ones_the_kv_cache_manager_caches_a_prompt_under() -> None:
    for tokens in ([5] * 3, list(range(12)), list(range(10))):
        pool = BlockPool(16)
        kv = KVCacheManager(pool, BLOCK_SIZE, enable_caching=True, max_cached_logits=4)
        req = Request("a", list(tokens), len(tokens), SamplingState(SamplingParams(), (0,)))
        assert kv.admit(req) is None
        req.num_computed_tokens = len(tokens)
        kv.commit(req, torch.zeros(8))
        hashes = prompt_block_hashes(tokens, BLOCK_SIZE)
        assert len(hashes) == -(-len(tokens) // BLOCK_SIZE)
        assert set(pool.cached_hashes()) == set(hashes)
        assert len(pool.match_prefix(hashes)) == len(hashes)
    assert prompt_block_hashes([], BLOCK_SIZE) == []


def test_match_counts_the_leading_run_per_worker_of_the_role_only() -> None:
    index = PrefixIndex()
    w = synced_worker(index)
    hashes = prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK_SIZE)
    assert index.match(hashes, "prefill") == {0: 3}
    assert index.match(hashes[:2] + [123], "prefill") == {0: 2}
    assert index.match([123, *hashes], "prefill") == {0: 0}  # the run starts at the first hash
    assert index.match(hashes, "decode") == {}
    assert index.block_size("prefill") == BLOCK_SIZE and index.block_size("decode") is None
    assert_in_sync(index, w, [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])


def test_remove_worker_drops_everything_it_held() -> None:
    index = PrefixIndex()
    w = synced_worker(index)
    index.remove_worker(w.key)
    assert index.hashes_of(w.key) == frozenset() and index.match(prompt_block_hashes([1, 2, 3, 4], 4), "prefill") == {}
    assert index.synced_seq(w.key) is None and index.block_size("prefill") is None


def test_gap_holds_later_batches_until_the_snapshot_then_replays_those_after_it() -> None:
    index = PrefixIndex()
    w = synced_worker(index)
    batches = []
    for tokens in ([1, 2, 3, 4, 9], [6, 6, 6, 6, 6], [1, 2, 3, 4, 5, 6, 7, 8, 0]):
        w.finish(random.Random(0))
        w.admit(tokens)
        w.publisher.publish(w.pool)
        batches += w.take_sent()
    assert [b.seq for b in batches] == [2, 3, 4]
    assert not index.apply(batches[1])  # 2 was lost: out of sync, hashes kept as a best guess
    assert index.synced_seq(w.key) is None and index.hashes_of(w.key)
    snap = w.publisher.snapshot(w.pool)  # taken after batch 4 ...
    w.admit([3, 3, 3, 3])
    w.publisher.publish(w.pool)
    (batch5,) = w.take_sent()
    assert index.apply(batches[2]) is False and index.apply(batch5) is False  # ... which still waits
    assert snap.seq == 4 and index.apply_snapshot(snap)  # 4 and older: in the snapshot; 5 replayed
    assert index.synced_seq(w.key) == 5
    assert_in_sync(index, w, [[1, 2, 3, 4, 5, 6, 7, 8, 0], [3, 3, 3, 3], [1, 2, 3, 4, 9]])
    assert index.apply(batches[2]) and index.synced_seq(w.key) == 5  # a late old batch changes nothing


def test_snapshot_that_arrives_first_is_followed_by_the_batches_after_it() -> None:
    index = PrefixIndex()
    w = synced_worker(index)
    w.admit([2, 2, 2, 2, 2])
    w.publisher.publish(w.pool)
    lost = w.take_sent()
    w.admit([4, 4, 4, 4])
    w.publisher.publish(w.pool)
    assert not index.apply(w.take_sent()[0])
    snap = w.publisher.snapshot(w.pool)
    assert index.apply_snapshot(snap) and index.synced_seq(w.key) == 3
    w.admit([5, 5])
    w.publisher.publish(w.pool)
    assert index.apply(w.take_sent()[0]) and index.synced_seq(w.key) == 4
    assert index.apply(lost[0]) and index.apply_snapshot(snap)  # stale: ignored
    assert_in_sync(index, w, [[2, 2, 2, 2, 2], [4, 4, 4, 4, 1], [5, 5]])


def test_a_snapshot_with_a_gap_after_it_asks_again() -> None:
    index = PrefixIndex()
    w = synced_worker(index)
    _publish(w, [2, 2, 2, 2])  # lost
    assert not index.apply(_publish(w, [3, 3, 3, 3]))
    old_snap = KvSnapshotEvent("prefill", 0, "a", 1, BLOCK_SIZE, [])
    assert not index.apply_snapshot(old_snap)  # 1, then the held 3: still a gap
    assert index.apply_snapshot(w.publisher.snapshot(w.pool)) and index.synced_seq(w.key) == 3
    assert_in_sync(index, w, [[2, 2, 2, 2], [3, 3, 3, 3]])


def _publish(w: SimWorker, tokens: list[int]) -> KvEventBatchEvent:
    w.take_sent()
    w.admit(tokens)
    w.publisher.publish(w.pool)
    (batch,) = w.take_sent()
    return batch


def test_new_incarnation_replaces_the_old_one_and_late_messages_of_the_old_one_are_ignored() -> None:
    index = PrefixIndex()
    old = synced_worker(index, "a")
    late = _publish(old, [6, 6, 6, 6])
    new = SimWorker(old.key, "b")
    assert index.apply(_publish(new, [8, 8, 8, 8, 8]))  # its batch 1: in sync at once, old hashes gone
    assert_in_sync(index, new, [[1, 2, 3, 4, 5], [8, 8, 8, 8, 8]])
    assert index.apply(late) and index.apply_snapshot(old.publisher.snapshot(old.pool))
    assert_in_sync(index, new, [[1, 2, 3, 4, 5], [6, 6, 6, 6], [8, 8, 8, 8, 8]])
    newer = SimWorker(old.key, "c")
    _publish(newer, [9, 9, 9, 9])  # its batch 1 is lost
    assert not index.apply(_publish(newer, [9, 9, 9, 9, 1]))
    assert index.hashes_of(old.key) == frozenset()  # nothing of "b" is left while "c" resyncs
    assert index.apply_snapshot(newer.publisher.snapshot(newer.pool))
    assert_in_sync(index, newer, [[9, 9, 9, 9, 1], [8, 8, 8, 8, 8]])


def test_pool_event_overflow_skips_a_seq_so_the_router_resyncs() -> None:
    index = PrefixIndex()
    w = SimWorker(WorkerKey("decode", 2), "a", max_pending_events=2)
    w.admit([1, 2])  # one event
    assert index.apply(_publish(w, [3, 4])) and w.pool.num_dropped_events == 0
    w.admit([5, 6, 7, 8, 9, 10, 11, 12, 13])  # three events into a queue of two
    batch = _publish(w, [14])  # ... and one more
    assert w.pool.num_dropped_events == 2 and (batch.seq, len(batch.events)) == (3, 2)
    assert not index.apply(batch)
    assert index.apply_snapshot(w.publisher.snapshot(w.pool))
    assert_in_sync(index, w, [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14], [3, 4]])


def test_publisher_sends_nothing_without_events_and_snapshots_after_publishing_what_is_pending() -> None:
    w = SimWorker(WorkerKey("prefill", 0), "a")
    assert w.publisher.publish(w.pool) is None and w.sent == []
    w.admit([1, 2, 3, 4, 5])
    snap = w.publisher.snapshot(w.pool)
    (batch,) = w.take_sent()
    assert (batch.seq, snap.seq) == (1, 1) and sorted(snap.hashes) == sorted(h for _, h in batch.events)
    assert w.publisher.snapshot(w.pool).seq == 1 and w.sent == []


def test_held_batches_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_index, "MAX_HELD_EVENTS", 10)
    index = PrefixIndex()
    w = synced_worker(index)
    _publish(w, [2, 2, 2, 2])  # lost
    held = [_publish(w, [3 + i] * 4) for i in range(6)]  # one event each: weight 2
    for batch in held:
        assert not index.apply(batch)
    assert not index.apply_snapshot(KvSnapshotEvent("prefill", 0, "a", 2, BLOCK_SIZE, []))  # oldest held went
    assert index.apply_snapshot(w.publisher.snapshot(w.pool))
    assert_in_sync(index, w, [[3] * 4, [8] * 4])
