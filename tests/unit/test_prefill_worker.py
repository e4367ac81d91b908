"""The prefill worker on CPU: it sends every first token of a step before it builds any handoff (a burst of
requests finishing their prefill in one step does not wait on the handoffs before it); its handshakes are
answered on their own thread, also while a step runs for seconds; under --transport auto the handshake names
the pair's transport, and a transport that cannot be opened is refused in the reply (the handshake socket
keeps answering)."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pdserve.core import ipc, worker_base
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.engine import RequestOutput
from pdserve.core.messages import (
    GenerateCmd,
    HandoffCmd,
    HandshakeCmd,
    HandshakeEvent,
    Message,
    Sampling,
    Timings,
    TokenEvent,
    decode,
    encode,
    pack_token_ids,
)
from pdserve.prefill_worker import worker as prefill_worker_module
from pdserve.prefill_worker.worker import PrefillWorker

STEP_S = 3.0
"""How long the blocked step of the handshake test takes."""


@pytest.fixture(params=["shm", "auto"])
def worker(tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[PrefillWorker]:
    run_dir = tempfile.mkdtemp(prefix="pdpo")  # NOTE: short: ipc:// paths are limited to ~100 bytes
    ctx = zmq.Context()
    sinks = [ipc.bind_pull(ctx, ipc.router_addr(run_dir)), ipc.bind_pull(ctx, ipc.decode_addr(run_dir, 0))]
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=64), device="cpu")
    transport = request.param
    if transport == "auto-broken":  # NOTE: the sources open in the constructor
        monkeypatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setattr(prefill_worker_module, "make_source", broken_source)
        transport = "auto"
    w = PrefillWorker(cfg, 0, run_dir, num_decode=1, transport=transport)
    try:
        yield w
    finally:
        w.close()
        for sock in sinks:
            sock.close()
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


def broken_source(*args: object) -> None:
    raise OSError("no shared memory here")


def handshake(worker: PrefillWorker, decode_worker: int) -> HandshakeEvent:
    """One handshake as a decode worker sends it (the worker's handshake thread answers)."""
    sock = worker.ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    sock.connect(ipc.handshake_addr(worker.run_dir, 0))
    try:
        sock.send(encode(HandshakeCmd(decode_worker, worker.layout.fingerprint())))
        reply = decode(sock.recv())
    finally:
        sock.close()
    assert isinstance(reply, HandshakeEvent)
    return reply


@pytest.mark.parametrize("worker", ["auto"], indirect=True)
def test_auto_handshake_names_the_pairs_transport(worker: PrefillWorker) -> None:
    assert not handshake(worker, 7).ok  # an unknown decode worker
    reply = handshake(worker, 0)  # one host (no topology): the host-local transport
    assert reply.ok and reply.descriptor["transport"] == "shm" and reply.pool_id == worker.incarnation


@pytest.mark.parametrize("worker", ["auto-broken"], indirect=True)
def test_auto_transport_that_cannot_open_is_refused_in_each_handshake(worker: PrefillWorker) -> None:
    for _ in range(2):  # the socket keeps answering
        refused = handshake(worker, 0)
        assert not refused.ok and "cannot open the shm KV transport: no shared memory here" in refused.error


@pytest.mark.parametrize("worker", ["shm"], indirect=True)
def test_handshake_is_answered_while_a_step_runs_for_seconds(
    worker: PrefillWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_step = threading.Event()

    def long_step() -> list[RequestOutput]:
        in_step.set()
        time.sleep(STEP_S)
        return []

    monkeypatch.setattr(worker.engine, "step", long_step)
    monkeypatch.setattr(worker_base.signal, "signal", lambda *args: None)  # NOTE: run() is off the main thread here
    loop = threading.Thread(target=worker.run)
    loop.start()
    try:
        sampling = Sampling(temperature=0.0, max_tokens=4, ignore_eos=True)
        push = ipc.connect_push(worker.ctx, ipc.prefill_addr(worker.run_dir, 0))
        assert ipc.send(push, GenerateCmd("r0", pack_token_ids([5] * 9), sampling, 0, Timings(arrival=1.0)))
        push.close()
        assert in_step.wait(STEP_S), "the loop never stepped"
        start = time.monotonic()
        reply = handshake(worker, 0)
        took = time.monotonic() - start
        assert reply.ok and took < STEP_S / 10, f"the handshake took {took:.3f} s of a {STEP_S} s step"
        assert in_step.is_set() and loop.is_alive()
    finally:
        worker._stop()
        loop.join(timeout=2 * STEP_S)


def test_a_steps_first_tokens_all_go_out_before_its_handoffs(
    worker: PrefillWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[Message] = []

    def record(sock: zmq.Socket, msg: Message, wait_ms: int = 200) -> bool:
        sent.append(msg)
        return True

    monkeypatch.setattr(ipc, "send", record)
    sampling = Sampling(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(3):
        worker.handle(
            GenerateCmd(
                f"r{i}", pack_token_ids([5 + i] * (9 + i)), sampling, decode_worker=0, timings=Timings(arrival=1.0)
            )
        )
    while len([m for m in sent if isinstance(m, HandoffCmd)]) < 3:
        assert worker.step_engine()
    kinds = [type(m) for m in sent if isinstance(m, (TokenEvent, HandoffCmd))]
    assert kinds == [TokenEvent] * 3 + [HandoffCmd] * 3, kinds
