"""The prefill worker sends every first token of a step before it builds any handoff: a burst of requests
finishing their prefill in one step does not wait on the handoffs (HandoffCmd encode and send) before it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from core import ipc
from core.config import CacheConfig, EngineConfig, ModelConfig
from core.messages import GenerateCmd, HandoffCmd, Message, Sampling, Timings, TokenEvent
from prefill_worker.worker import PrefillWorker


@pytest.fixture
def worker(tiny_llama_dir: Path) -> Iterator[PrefillWorker]:
    run_dir = tempfile.mkdtemp(prefix="pdpo")  # NOTE: short: ipc:// paths are limited to ~100 bytes
    ctx = zmq.Context()
    sinks = [ipc.bind_pull(ctx, ipc.router_addr(run_dir)), ipc.bind_pull(ctx, ipc.decode_addr(run_dir, 0))]
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=64), device="cpu")
    w = PrefillWorker(cfg, 0, run_dir, num_decode=1, transport="shm")
    try:
        yield w
    finally:
        w.close()
        for sock in sinks:
            sock.close()
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


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
        worker.handle(GenerateCmd(f"r{i}", [5 + i] * (9 + i), sampling, decode_worker=0, timings=Timings(arrival=1.0)))
    while len([m for m in sent if isinstance(m, HandoffCmd)]) < 3:
        assert worker.step_engine()
    kinds = [type(m) for m in sent if isinstance(m, (TokenEvent, HandoffCmd))]
    assert kinds == [TokenEvent] * 3 + [HandoffCmd] * 3, kinds
