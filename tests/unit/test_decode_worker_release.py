"""The decode worker's handoffs in flight: a handed-off request holds its blocks without decoding until its pull's
handle is done (polled in after_step), then decodes and its ReleaseCmd goes out; at once when the pull failed
or was synchronous (shm); an abort meanwhile frees its blocks when the copy is done; at shutdown the leases go
back after waiting for the copies; the idle loop polls fast meanwhile.

A real DecodeWorker on the tiny llama (CPU, shm transport) in this process; sockets bound here stand in for
the router and prefill worker 0; a sink whose handles the test completes stands in for an async transport.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import zmq

from pdserve.core import ipc
from pdserve.core.block_pool import hash_full_blocks
from pdserve.core.busy_poll import busy_poll_seconds
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.messages import (
    AbortCmd,
    HandoffCmd,
    Message,
    ReleaseCmd,
    RequestErrorEvent,
    Sampling,
    Timings,
    pack_block_hashes,
    pack_token_ids,
)
from pdserve.core.worker_base import PENDING_POLL_MS
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.kvtransfer.base import KVTransferError, PullHandle
from pdserve.kvtransfer.factory import make_source
from pdserve.kvtransfer.pool import allocate_kv_pool
from pdserve.kvtransfer.shm import ShmSink

POOL_ID = "pool-a"
PROMPT = [5, 9, 2, 7, 1, 8, 3, 4, 6, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # 18 tokens: KV of 17 in 2 blocks
FIRST_TOKEN = 21
RECV_TIMEOUT_MS = 2000
QUIET_MS = 100


class FlipHandle(PullHandle):
    """A copy in flight until the test sets copied (or the worker waits for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.copied = False
        self.num_waits = 0

    def done(self) -> bool:
        return self.copied

    def wait(self) -> None:
        self.num_waits += 1
        self.copied = True


class AsyncSink(ShmSink):
    """Records pulls and answers each with a FlipHandle (copies nothing); raises while fail is set."""

    def __init__(self, sink: ShmSink) -> None:
        super().__init__(sink.local_pool, sink.layout)
        self.handles: list[FlipHandle] = []
        self.fail = False

    def pull(self, prefill_worker: int, src_block_ids: list[int], dst_block_ids: list[int]) -> PullHandle:
        if self.fail:
            raise KVTransferError("mapping lost")
        self.handles.append(FlipHandle())
        return self.handles[-1]


class Harness(NamedTuple):
    worker: DecodeWorker
    prefill: zmq.Socket  # what prefill worker 0 receives
    router: zmq.Socket  # what the router receives


@pytest.fixture
def harness(tiny_llama_dir: Path) -> Iterator[Harness]:
    run_dir = tempfile.mkdtemp(prefix="pdrel")  # NOTE: short: ipc:// paths are limited to ~100 bytes
    ctx = zmq.Context()
    prefill = ipc.bind_pull(ctx, ipc.prefill_addr(run_dir, 0))
    router = ipc.bind_pull(ctx, ipc.router_addr(run_dir))
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=24), device="cpu")
    worker = DecodeWorker(cfg, 0, run_dir, num_prefill=1, transport="shm")
    worker.peers[0] = POOL_ID  # the handshake with prefill worker 0 is done
    worker.sink_of[0] = worker.sinks["shm"]
    try:
        yield Harness(worker, prefill, router)
    finally:
        worker.close()
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


def async_sink(worker: DecodeWorker) -> AsyncSink:
    sink = worker.sink_of[0]
    assert isinstance(sink, ShmSink)
    worker.sink_of[0] = wrapped = AsyncSink(sink)
    return wrapped


def handoff(request_id: str, lease_id: int, block_ids: list[int] | None = None, hashes: bytes = b"") -> HandoffCmd:
    sampling = Sampling(temperature=0.0, max_tokens=4, ignore_eos=True, num_generated=1)
    token_ids = pack_token_ids([*PROMPT, FIRST_TOKEN])
    return HandoffCmd(
        request_id, 0, POOL_ID, lease_id, block_ids or [3, 4], token_ids, len(PROMPT), 0, sampling, Timings(), hashes
    )


def received(sock: zmq.Socket, count: int) -> list[Message]:
    """The next count messages on sock, then whatever else arrives within QUIET_MS (so extras show)."""
    got: list[Message] = []
    while len(got) < count and sock.poll(RECV_TIMEOUT_MS):
        got += ipc.recv_all(sock)
    while sock.poll(QUIET_MS):
        got += ipc.recv_all(sock)
    return got


def test_request_waits_for_its_copy_then_decodes_and_its_lease_is_released(harness: Harness) -> None:
    worker, engine = harness.worker, harness.worker.engine
    sink = async_sink(worker)
    worker.handle(handoff("a", lease_id=7))
    assert len(sink.handles) == 1 and worker.counters()["releases_pending"] == 1 and worker.has_pending_work()
    for _ in range(2):  # NOTE: the steps of the other requests go on meanwhile; this one is not in them
        assert engine.step() == [] and not engine.scheduler.running and engine.num_adopted == 1
        worker.after_step()
    blocks = engine.requests["a"].block_ids
    assert len(blocks) == 2 and engine.pool.num_cached_blocks == 0  # held, not offered to the prefix cache yet
    assert worker.heartbeat_event().num_running == 1 and "a" not in worker.timings
    sink.handles[0].copied = True
    worker.after_step()
    assert worker.counters()["releases_pending"] == 0 and not worker.has_pending_work()
    assert engine.scheduler.running == [engine.requests["a"]] and engine.num_adopted == 0
    assert engine.pool.num_cached_blocks == 1 and worker.timings["a"].handoff_end > 0
    assert received(harness.prefill, 1) == [ReleaseCmd(0, [7], POOL_ID)]  # once, and not before the copy was done
    worker.after_step()
    assert received(harness.prefill, 0) == []
    outputs = engine.step() + engine.step()  # NOTE: a decode step's tokens come out one step() later
    assert [out.request_id for out in outputs] == ["a"]


def test_each_lease_waits_for_its_own_copy(harness: Harness) -> None:
    worker = harness.worker
    sink = async_sink(worker)
    worker.handle(handoff("a", lease_id=1))
    worker.handle(handoff("b", lease_id=2, block_ids=[8, 9]))
    sink.handles[1].copied = True  # completion order need not be handoff order
    worker.after_step()
    assert worker.counters()["releases_pending"] == 1
    assert [r.request_id for r in worker.engine.scheduler.running] == ["b"]
    sink.handles[0].copied = True
    worker.after_step()
    assert received(harness.prefill, 2) == [ReleaseCmd(0, [2], POOL_ID), ReleaseCmd(0, [1], POOL_ID)]
    assert [r.request_id for r in worker.engine.scheduler.running] == ["b", "a"]


def test_aborted_request_keeps_its_blocks_and_lease_until_the_copy_is_done_and_the_idle_loop_polls_fast(
    harness: Harness,
) -> None:
    worker, pool = harness.worker, harness.worker.engine.pool
    sink = async_sink(worker)
    assert worker._poll_timeout_ms() == 250
    worker.handle(handoff("a", lease_id=3))
    assert not worker.engine.has_unfinished()  # adopted, not scheduled
    assert worker._poll_timeout_ms() == PENDING_POLL_MS  # idle, but a copy is due to finish soon
    worker.handle(AbortCmd("a"))
    assert worker.num_aborted == 1 and pool.num_used_blocks == 2  # the copy still writes them
    worker.after_step()
    assert worker.counters()["releases_pending"] == 1  # the source blocks may still be read
    sink.handles[0].copied = True
    worker.after_step()
    assert received(harness.prefill, 1) == [ReleaseCmd(0, [3], POOL_ID)]
    assert pool.num_used_blocks == 0 and "a" not in worker.engine.requests and not worker.engine.has_unfinished()
    assert worker._poll_timeout_ms() == 250


def test_a_handoff_reusing_an_id_whose_abort_waits_for_its_copy_waits_too(harness: Harness) -> None:
    worker = harness.worker
    sink = async_sink(worker)
    worker.handle(handoff("a", lease_id=1))
    worker.handle(AbortCmd("a"))
    worker.handle(handoff("a", lease_id=2, block_ids=[8, 9]))  # e.g. the router's retry
    assert len(sink.handles) == 1 and len(worker.waiting) == 1
    sink.handles[0].copied = True
    worker.after_step()
    assert len(sink.handles) == 2 and not worker.waiting and worker.engine.num_adopted == 1
    sink.handles[1].copied = True
    worker.after_step()
    assert [r.request_id for r in worker.engine.scheduler.running] == ["a"]
    assert received(harness.prefill, 2) == [ReleaseCmd(0, [1], POOL_ID), ReleaseCmd(0, [2], POOL_ID)]


def test_busy_polling_keeps_the_loop_awake_for_its_window_after_work(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = harness.worker
    now = [100.0]
    monkeypatch.setattr("pdserve.core.worker_base.time.monotonic", lambda: now[0])
    worker.busy_poll_s = 1.0
    worker._last_work = now[0]  # what run() records after a poll that found messages, or a step
    assert worker._poll_timeout_ms() == 0
    now[0] += 0.99
    assert worker._poll_timeout_ms() == 0
    now[0] += 0.02
    assert worker._poll_timeout_ms() == 250  # the window is over: block until a message or a heartbeat
    worker.busy_poll_s = 0.0
    worker._last_work = now[0]
    assert worker._poll_timeout_ms() == 250  # off (a CPU worker's default): never spins


BUSY_POLL_CASES = [(None, "cuda", 1.0), (None, "cuda:1", 1.0), (None, "cpu", 0.0), (5.0, "cpu", 0.005)]
BUSY_POLL_CASES += [(0.0, "cuda", 0.0), (-1.0, "cuda", 0.0)]


@pytest.mark.parametrize(("flag", "device", "seconds"), BUSY_POLL_CASES)
def test_busy_poll_defaults_to_cuda_workers_only(flag: float | None, device: str, seconds: float) -> None:
    assert busy_poll_seconds(flag, device) == seconds


def test_failed_pull_releases_at_once_and_reports_the_request(harness: Harness) -> None:
    worker = harness.worker
    sink = async_sink(worker)
    sink.fail = True
    worker.handle(handoff("a", lease_id=4))
    assert worker.counters()["releases_pending"] == 0 and not worker.engine.requests
    assert worker.engine.pool.num_used_blocks == 0  # nothing in flight: freed at once
    assert received(harness.prefill, 1) == [ReleaseCmd(0, [4], POOL_ID)]
    (error,) = received(harness.router, 1)
    assert isinstance(error, RequestErrorEvent) and (error.request_id, error.code) == ("a", "UNAVAILABLE")


def test_close_waits_for_copies_in_flight_and_releases_their_leases(harness: Harness) -> None:
    worker = harness.worker
    sink = async_sink(worker)
    worker.handle(handoff("a", lease_id=5))
    worker.close()
    assert sink.handles[0].num_waits == 1 and worker.counters()["releases_pending"] == 0
    assert received(harness.prefill, 1) == [ReleaseCmd(0, [5], POOL_ID)]


def test_shm_pull_is_synchronous_so_the_lease_is_released_in_the_same_call(harness: Harness) -> None:
    worker = harness.worker
    source = allocate_kv_pool(replace(worker.layout, num_blocks=16), "cpu", shared=True)
    try:
        source.tensor.copy_(torch.randn(source.layout.shape, generator=torch.Generator().manual_seed(0)))
        worker.sinks["shm"].open(0, make_source("shm", source).descriptor())
        worker.handle(handoff("a", lease_id=6, block_ids=[11, 2]))
        assert worker.counters()["releases_pending"] == 0
        assert received(harness.prefill, 1) == [ReleaseCmd(0, [6], POOL_ID)]
        dst = worker.engine.requests["a"].block_ids
        assert worker.kv_pool is not None
        assert torch.equal(worker.kv_pool.tensor[:, :, dst], source.tensor[:, :, [11, 2]])
    finally:
        source.close()


def test_block_hashes_must_be_one_per_full_block_or_none(harness: Harness) -> None:
    worker = harness.worker
    own = hash_full_blocks(PROMPT, worker.cfg.cache.block_size)  # 1 full block of the 18 computed tokens
    worker.handle(handoff("bad", lease_id=8, hashes=pack_block_hashes([*own, 7])))
    assert not worker.engine.has_unfinished() and not worker.waiting  # dropped
    async_sink(worker)
    worker.handle(handoff("good", lease_id=9, hashes=pack_block_hashes(own)))
    assert worker.engine.requests["good"].block_hashes[:1] == own
