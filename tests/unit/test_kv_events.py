"""KV event messages on the wire, and the real sockets: a worker-side publisher's batches reach the router's
WorkerHub over ipc://, a gap makes the hub ask the worker for a snapshot through its inbox, and a real worker
answers one with the hashes the router computes for its prompt."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from pdserve.core import ipc
from pdserve.core.block_pool import BlockPool
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.kv_events import KvEventPublisher, KvOrigin
from pdserve.core.messages import (
    KV_REMOVED,
    KV_STORED,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    HeartbeatEvent,
    KvEventBatchEvent,
    KvSnapshotCmd,
    KvSnapshotEvent,
    MessageError,
    decode,
    encode,
)
from pdserve.core.sampling_params import SamplingParams
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.router.config import RouterConfig
from pdserve.router.prefix_index import WorkerKey, prompt_block_hashes
from pdserve.router.workers import WorkerHub

MAX_HASH = (1 << 64) - 1
WAIT_S = 5.0


def test_kv_messages_round_trip_with_unsigned_64_bit_hashes() -> None:
    batch = KvEventBatchEvent("prefill", 1, "inc", 7, 16, [(KV_STORED, MAX_HASH), (KV_REMOVED, MAX_HASH), (1, 0)])
    snap = KvSnapshotEvent("decode", 0, "inc", 7, 16, [MAX_HASH, 0, 1 << 63])
    for msg in (batch, snap, KvSnapshotCmd()):
        assert decode(encode(msg)) == msg


def test_a_snapshot_costs_at_most_9_bytes_a_hash_and_one_over_the_size_limit_is_refused() -> None:
    def frame(num_hashes: int) -> bytes:
        return encode(KvSnapshotEvent("prefill", 0, "inc", 3, 16, [MAX_HASH] * num_hashes))

    assert len(frame(10_000)) - len(frame(0)) <= 9 * 10_000 + 4  # 9 bytes a uint64, then the list's header
    with pytest.raises(MessageError, match="exceeds"):
        decode(frame(MAX_MESSAGE_BYTES // 9 + 1))


def kv_frame(tag: str, **fields: Any) -> bytes:
    base = {"role": "prefill", "worker_id": 0, "incarnation": "inc", "seq": 1, "block_size": 16}
    return msgpack.packb([PROTOCOL_VERSION, tag, {**base, **fields}], use_bin_type=True)


@pytest.mark.parametrize(
    "fields",
    [
        {"events": [[2, 5]]},
        {"events": [[True, 5]]},
        {"events": [[1, -5]]},
        {"events": [[1, "5"]]},
        {"events": [[1, 5.0]]},
        {"events": [[1, 5, 6]]},
        {"events": {"1": 5}},
        {"events": [], "role": "router"},
        {"events": [], "seq": -1},
        {"events": [], "block_size": 0},
        {"events": [], "worker_id": "0"},
        {"events": [], "bogus": 1},
        {},
    ],
)
def test_a_malformed_kv_batch_is_a_message_error(fields: dict[str, Any]) -> None:
    with pytest.raises(MessageError):
        decode(kv_frame(KvEventBatchEvent.TAG, **fields))


@pytest.mark.parametrize("hashes", [[-1], ["a"], [1.5], [[1]], None, 3])
def test_a_malformed_kv_snapshot_is_a_message_error(hashes: object) -> None:
    with pytest.raises(MessageError):
        decode(kv_frame(KvSnapshotEvent.TAG, hashes=hashes))


# --- real sockets -----------------------------------------------------------------------------------


async def eventually(predicate: Callable[[], bool], tick: Callable[[], None] = lambda: None) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        tick()
        await asyncio.sleep(0.005)


class FakePrefillWorker:
    """Prefill worker 0 as far as KV events go: a pool, its publisher, and an inbox answering KvSnapshotCmd."""

    def __init__(self, ctx: zmq.Context, run_dir: Path, max_pending_events: int = 100) -> None:
        self.pool = BlockPool(8, max_pending_events)
        self.inbox = ipc.bind_pull(ctx, ipc.prefill_addr(run_dir, 0))
        self.to_router = ipc.connect_push(ctx, ipc.router_addr(run_dir))
        origin = KvOrigin("prefill", 0, "inc", 16)
        self.publisher = KvEventPublisher.bind(ctx, ipc.kv_events_addr(run_dir, "prefill", 0), origin)
        self.num_snapshots = 0
        self._next_hash = 100

    def cache_new_block(self) -> None:
        """One more cached block (evicting the oldest free one when the pool is full), published."""
        (block_id,) = self.pool.allocate(1)
        self.pool.cache_block(block_id, self._next_hash)
        self.pool.free([block_id])
        self._next_hash += 1

    def serve(self) -> None:
        for msg in ipc.recv_all(self.inbox):
            assert isinstance(msg, KvSnapshotCmd)
            assert ipc.send(self.to_router, self.publisher.snapshot(self.pool))
            self.num_snapshots += 1


def test_batches_reach_the_hub_over_ipc_and_a_gap_is_resynced_through_the_inbox(run_dir: Path) -> None:
    async def body() -> None:
        hub = WorkerHub(RouterConfig("unused", str(run_dir), num_prefill=1, num_decode=1, heartbeat_timeout=30))
        hub.start()
        ctx = zmq.Context()
        try:
            worker = FakePrefillWorker(ctx, run_dir, max_pending_events=2)
            key, index = WorkerKey("prefill", 0), hub.prefix_index

            def in_sync() -> bool:
                return index.synced_seq(key) == worker.publisher.seq and index.hashes_of(key) == set(
                    worker.pool.cached_hashes()
                )

            def publish_new_block() -> None:  # until the SUB has joined, batches are lost (the slow joiner)
                worker.cache_new_block()
                worker.publisher.publish(worker.pool)
                worker.serve()

            hb = HeartbeatEvent("prefill", 0, os.getpid(), "inc", 1, 7, 0, 0)
            assert ipc.send(worker.to_router, hb)  # up: asked for a snapshot (again while out of sync)
            await eventually(lambda: index.synced_seq(key) is not None, publish_new_block)
            await eventually(in_sync, worker.serve)
            assert hub.kv_block_size("prefill") == 16 and hub.kv_block_size("decode") is None

            num_snapshots = worker.num_snapshots
            for _ in range(3):  # 3 events into a queue of 2: one is lost, the batch skips a seq
                worker.cache_new_block()
            worker.publisher.publish(worker.pool)
            await eventually(lambda: worker.num_snapshots > num_snapshots, worker.serve)
            await eventually(in_sync, worker.serve)
            assert worker.pool.num_dropped_events >= 1

            restarted = HeartbeatEvent("prefill", 0, os.getpid(), "inc2", 1, 7, 0, 0)
            assert ipc.send(worker.to_router, restarted)
            await eventually(lambda: index.synced_seq(key) is None and not index.hashes_of(key))  # dropped at once
        finally:
            await hub.close()
            ctx.destroy(linger=0)

    asyncio.run(body())


def test_a_real_worker_answers_kv_snapshot_cmd_with_the_hashes_the_router_computes(
    run_dir: Path, tiny_llama_dir: Path
) -> None:
    ctx = zmq.Context()
    router = ipc.bind_pull(ctx, ipc.router_addr(run_dir))
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=24), device="cpu")
    worker = DecodeWorker(cfg, 0, str(run_dir), num_prefill=1, transport="shm")
    try:
        worker.kv_events = worker._bind_kv_events()  # what run() does first
        prompt = [5, 9, 2, 7, 1, 8, 3, 4, 6, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # 1 full block + 4
        worker.engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=1))
        while worker.engine.has_unfinished():
            worker.engine.step()
            worker.engine.flush_commits()  # what run() does after each step
        worker._safe_handle(KvSnapshotCmd())
        assert router.poll(int(WAIT_S * 1000))
        (snap,) = ipc.recv_all(router)
        assert isinstance(snap, KvSnapshotEvent)
        assert (snap.role, snap.worker_id, snap.incarnation) == ("decode", 0, worker.incarnation)
        assert (snap.seq, snap.block_size) == (1, 16)  # the prompt's events went out as batch 1 first
        assert sorted(snap.hashes) == sorted(prompt_block_hashes(prompt, 16))
    finally:
        worker.close()
        ctx.destroy(linger=0)
