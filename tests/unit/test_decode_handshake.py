"""The decode worker's handshakes run in the background: a handoff from a prefill worker whose pool is not open
yet waits (leased, holding none of our blocks) while every other request keeps decoding; it is adopted once
the reply comes, and fails like a failed pull (UNAVAILABLE, the router migrates it; its lease released
unless its pool is stale) when the reply is a refusal, names another pool, or does not come in time. An
abort releases a waiting handoff's lease. Every block is back in the pool afterwards.

A real DecodeWorker on the tiny llama (CPU, shm transport) in this process, with two prefill workers: 0 is
open already (a real shm pool), 1 is a REP socket the test answers by hand (late, wrongly, or never).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import zmq

from pdserve.core import ipc
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.messages import (
    AbortCmd,
    HandoffCmd,
    HandshakeCmd,
    HandshakeEvent,
    Message,
    ReleaseCmd,
    RequestErrorEvent,
    Sampling,
    Timings,
    TokenBatchEvent,
    decode,
    encode,
    pack_token_ids,
)
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.kvtransfer.factory import make_source
from pdserve.kvtransfer.pool import KVPool, allocate_kv_pool

PROMPT = [5, 9, 2, 7, 1, 8, 3, 4, 6, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # 18 tokens: KV of 18 in 2 blocks
POOLS = ("pool-a", "pool-b")  # prefill worker i's pool id
MAX_TOKENS = 24
SLOW_ITERATION_S = 0.3
"""No loop iteration (step + housekeeping) may take this long while a handshake is pending (a blocking one
took its whole timeout; a step of the tiny model is ~10 ms, ~100 ms on a loaded 2-core host)."""
TIMEOUT_S = 1.0
WAIT_S = 20.0


class Harness(NamedTuple):
    worker: DecodeWorker
    prefill: list[zmq.Socket]  # what prefill worker i receives (ReleaseCmd)
    router: zmq.Socket
    endpoint: zmq.Socket  # prefill worker 1's handshake socket, answered by the test
    pools: list[KVPool]  # prefill worker i's KV pool


@pytest.fixture
def harness(tiny_llama_dir: Path) -> Iterator[Harness]:
    run_dir = tempfile.mkdtemp(prefix="pdhsk")  # NOTE: short: ipc:// paths are limited to ~100 bytes
    ctx = zmq.Context()
    prefill = [ipc.bind_pull(ctx, ipc.prefill_addr(run_dir, i)) for i in range(2)]
    router = ipc.bind_pull(ctx, ipc.router_addr(run_dir))
    endpoint = ctx.socket(zmq.REP)
    endpoint.setsockopt(zmq.LINGER, 0)
    endpoint.bind(ipc.handshake_addr(run_dir, 1))
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=24), device="cpu")
    worker = DecodeWorker(cfg, 0, run_dir, num_prefill=2, transport="shm")
    pools = []
    for seed in range(2):
        pool = allocate_kv_pool(replace(worker.layout, num_blocks=16), "cpu", shared=True)
        pool.tensor.copy_(torch.randn(pool.layout.shape, generator=torch.Generator().manual_seed(seed)))
        pools.append(pool)
    worker.sinks["shm"].open(0, make_source("shm", pools[0]).descriptor())
    worker.peers[0] = POOLS[0]  # the handshake with prefill worker 0 is done
    worker.sink_of[0] = worker.sinks["shm"]
    try:
        yield Harness(worker, prefill, router, endpoint, pools)
    finally:
        worker.close()
        for pool in pools:
            pool.close()
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


def handoff(request_id: str, prefill_worker: int, lease_id: int, pool_id: str | None = None) -> HandoffCmd:
    sampling = Sampling(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, num_generated=1)
    pool_id = POOLS[prefill_worker] if pool_id is None else pool_id
    prompt = PROMPT if prefill_worker == 0 else PROMPT[::-1]  # NOTE: no block of it is in our prefix cache
    return HandoffCmd(
        request_id, prefill_worker, pool_id, lease_id, [3, 4], pack_token_ids([*prompt, 21]), len(PROMPT), 0,
        sampling, Timings(),
    )  # fmt: skip


def iterate(worker: DecodeWorker) -> float:
    """One loop iteration as WorkerBase.run does it; how long it took."""
    start = time.monotonic()
    if worker.engine.has_unfinished():
        worker.step_engine()
        worker.engine.flush_commits()
    worker.after_step()
    return time.monotonic() - start


def drain(sock: zmq.Socket, quiet_ms: int = 100) -> list[Message]:
    """Whatever arrives on sock until it has been quiet for quiet_ms."""
    got: list[Message] = []
    while sock.poll(quiet_ms):
        got += ipc.recv_all(sock)
    return got


def tokens_of(messages: list[Message], request_id: str) -> int:
    batches = [m for m in messages if isinstance(m, TokenBatchEvent)]
    return sum(len(e.token_ids) for b in batches for e in b.events if e.request_id == request_id)


def answer(h: Harness, reply: HandshakeEvent) -> None:
    """Prefill worker 1's handshake socket takes the request waiting there and answers it."""
    assert h.endpoint.poll(1000), "no handshake came"
    request = decode(h.endpoint.recv())
    assert isinstance(request, HandshakeCmd) and request.decode_worker == 0
    h.endpoint.send(encode(reply))


def pool_descriptor(h: Harness) -> HandshakeEvent:
    return HandshakeEvent(ok=True, pool_id=POOLS[1], descriptor=make_source("shm", h.pools[1]).descriptor())


def all_blocks_free(worker: DecodeWorker) -> bool:
    return worker.engine.pool.num_free_blocks == worker.engine.pool.num_blocks - 1


def finish(h: Harness) -> None:
    deadline = time.monotonic() + WAIT_S
    while h.worker.engine.has_unfinished() and time.monotonic() < deadline:
        iterate(h.worker)
    assert not h.worker.engine.has_unfinished() and all_blocks_free(h.worker)


def test_other_requests_decode_while_a_handshake_is_pending_and_the_handoff_goes_on_after_the_reply(
    harness: Harness,
) -> None:
    h, worker = harness, harness.worker
    worker.handle(handoff("a", 0, lease_id=1))
    worker.handle(handoff("b", 1, lease_id=2))
    assert "a" in worker.engine.requests and "b" not in worker.engine.requests
    assert worker.handshakes.pending(1) and worker.counters()["handoffs_waiting"] == 1
    used = worker.engine.pool.num_blocks - 1 - worker.engine.pool.num_free_blocks
    slowest = max(iterate(worker) for _ in range(8))
    assert tokens_of(drain(h.router), "a") >= 7 and slowest < SLOW_ITERATION_S  # a decoded meanwhile
    assert "b" not in worker.engine.requests  # and b holds none of our blocks
    assert worker.engine.pool.num_blocks - 1 - worker.engine.pool.num_free_blocks == used
    answer(h, pool_descriptor(h))
    deadline = time.monotonic() + WAIT_S
    while "b" not in worker.engine.requests and time.monotonic() < deadline:
        worker.after_step()
    dst = worker.engine.requests["b"].block_ids[:2]
    assert worker.kv_pool is not None and torch.equal(worker.kv_pool.tensor[:, :, dst], h.pools[1].tensor[:, :, [3, 4]])
    assert drain(h.prefill[1]) == [ReleaseCmd(0, [2], POOLS[1])] and worker.peers[1] == POOLS[1]
    finish(h)
    assert drain(h.prefill[0]) == [ReleaseCmd(0, [1], POOLS[0])]
    assert tokens_of(drain(h.router), "b") == MAX_TOKENS - 1


def test_a_handshake_without_reply_fails_its_handoffs_after_the_timeout_and_releases_their_leases(
    harness: Harness,
) -> None:
    h, worker = harness, harness.worker
    worker.handshakes.timeout_s = TIMEOUT_S
    start = time.monotonic()
    worker.handle(handoff("a", 0, lease_id=1))
    worker.handle(handoff("b", 1, lease_id=2))
    worker.handle(handoff("c", 1, lease_id=3))  # waits on the same handshake
    errors: list[RequestErrorEvent] = []
    tokens_a, slowest = 0, 0.0
    while not errors and time.monotonic() - start < WAIT_S:
        slowest = max(slowest, iterate(worker))
        got = drain(h.router, quiet_ms=0)
        tokens_a += tokens_of(got, "a")
        errors += [m for m in got if isinstance(m, RequestErrorEvent)]
    took = time.monotonic() - start
    assert [(e.request_id, e.code) for e in errors] == [("b", "UNAVAILABLE"), ("c", "UNAVAILABLE")]
    assert isinstance(errors[0], RequestErrorEvent) and "no handshake reply from peer 1 within 1 s" in errors[0].message
    assert TIMEOUT_S <= took < TIMEOUT_S + 2 * SLOW_ITERATION_S and slowest < SLOW_ITERATION_S
    assert tokens_a >= 3  # a decoded meanwhile
    assert drain(h.prefill[1]) == [ReleaseCmd(0, [2], POOLS[1]), ReleaseCmd(0, [3], POOLS[1])]
    assert not worker.held.get(1)
    finish(h)


def test_a_refused_or_stale_handshake_fails_its_handoffs_and_an_abort_releases_a_waiting_one(
    harness: Harness,
) -> None:
    h, worker = harness, harness.worker
    worker.handle(handoff("b", 1, lease_id=2))
    answer(h, HandshakeEvent(ok=False, error="block_size 16 != 32"))
    deadline = time.monotonic() + WAIT_S
    while worker.held and time.monotonic() < deadline:
        worker.after_step()
    (error,) = drain(h.router)
    assert isinstance(error, RequestErrorEvent) and "refused the handshake: block_size 16 != 32" in error.message
    assert drain(h.prefill[1]) == [ReleaseCmd(0, [2], POOLS[1])]

    worker.handle(handoff("stale", 1, lease_id=4, pool_id="pool-before-restart"))
    worker.handle(handoff("aborted", 1, lease_id=5))
    worker.handle(AbortCmd("aborted"))
    assert drain(h.prefill[1]) == [ReleaseCmd(0, [5], POOLS[1])]
    answer(h, pool_descriptor(h))
    while worker.held and time.monotonic() < deadline:
        worker.after_step()
    (error,) = drain(h.router)
    assert isinstance(error, RequestErrorEvent) and (error.request_id, error.code) == ("stale", "UNAVAILABLE")
    assert drain(h.prefill[1]) == []  # NOTE: a stale pool's lease id may name a lease of the new pool
    assert worker.peers[1] == POOLS[1] and all_blocks_free(worker)
