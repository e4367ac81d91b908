"""The prefill worker on CPU: it sends every first token of a step before it builds any handoff (a burst of
requests finishing their prefill in one step does not wait on the handoffs before it); under --transport auto
its handshake names the pair's transport, and a transport that cannot be opened is refused in the reply
(the handshake socket keeps answering)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pdserve.core import ipc
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
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


@pytest.fixture(params=["shm", "auto"])
def worker(tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[PrefillWorker]:
    run_dir = tempfile.mkdtemp(prefix="pdpo")  # NOTE: short: ipc:// paths are limited to ~100 bytes
    ctx = zmq.Context()
    sinks = [ipc.bind_pull(ctx, ipc.router_addr(run_dir)), ipc.bind_pull(ctx, ipc.decode_addr(run_dir, 0))]
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=64), device="cpu")
    w = PrefillWorker(cfg, 0, run_dir, num_decode=1, transport=request.param)
    try:
        yield w
    finally:
        w.close()
        for sock in sinks:
            sock.close()
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


def handshake(worker: PrefillWorker, decode_worker: int) -> HandshakeEvent:
    """One handshake as a decode worker sends it, answered by the worker's handler."""
    sock = worker.ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    sock.connect(ipc.handshake_addr(worker.run_dir, 0))
    try:
        sock.send(encode(HandshakeCmd(decode_worker, worker.layout.fingerprint())))
        assert worker.handshake.poll(2000), "no handshake arrived"
        worker.handle_socket(worker.handshake)
        reply = decode(sock.recv())
    finally:
        sock.close()
    assert isinstance(reply, HandshakeEvent)
    return reply


@pytest.mark.parametrize("worker", ["auto"], indirect=True)
def test_auto_handshake_names_the_pairs_transport_and_survives_a_failed_open(
    worker: PrefillWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise OSError("no shared memory here")

    monkeypatch.setattr(prefill_worker_module, "make_source", broken)
    refused = handshake(worker, 0)
    assert not refused.ok and "cannot open the shm KV transport: no shared memory here" in refused.error
    monkeypatch.undo()
    assert not handshake(worker, 7).ok  # an unknown decode worker
    reply = handshake(worker, 0)  # one host (no topology): the host-local transport
    assert reply.ok and reply.descriptor["transport"] == "shm"


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
