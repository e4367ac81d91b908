"""Workers of a cluster with two front ends: each request's tokens go to the front end its GenerateCmd (or
HandoffCmd) names, one frame per front end per step; when a front end takes none (it is gone), the decode
worker aborts its requests (their blocks free at once) and the prefill worker hands none of them off, while the
other front end's requests go on.

A real DecodeWorker on the tiny llama (CPU) in this process, fed GenerateCmds directly (colocated mode);
PULL sockets bound here stand in for the front ends.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import zmq

from pdserve.core import ipc
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.messages import GenerateCmd, HandoffCmd, Sampling, TokenBatchEvent, TokenEvent, pack_token_ids
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.prefill_worker.worker import PrefillWorker
from tests.unit.test_decode_worker_release import received

PROMPT = [5, 9, 2, 7, 1, 8, 3, 4, 6]
NUM_BLOCKS = 24


@pytest.fixture
def worker(tiny_llama_dir: Path) -> Iterator[DecodeWorker]:
    run_dir = tempfile.mkdtemp(prefix="pdfe")  # NOTE: short: ipc:// paths are limited to ~100 bytes
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=NUM_BLOCKS), device="cpu")
    worker = DecodeWorker(cfg, 0, run_dir, num_prefill=0, transport="shm", num_frontends=2)
    try:
        yield worker
    finally:
        worker.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def generate(request_id: str, frontend: int, max_tokens: int = 3) -> GenerateCmd:
    sampling = Sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return GenerateCmd(request_id, pack_token_ids(PROMPT), sampling, 0, frontend=frontend)


def tokens_by_request(msgs: Sequence[object]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for msg in msgs:
        assert isinstance(msg, TokenBatchEvent)
        for event in msg.events:
            assert isinstance(event, TokenEvent)
            out.setdefault(event.request_id, []).extend(event.token_ids)
    return out


def test_each_front_end_gets_its_own_requests_tokens_one_frame_a_step(worker: DecodeWorker) -> None:
    ctx = zmq.Context()
    try:
        inboxes = [ipc.bind_pull(ctx, ipc.router_addr(worker.run_dir, k)) for k in range(2)]
        for cmd in (generate("a", 0), generate("b", 1), generate("c", 1)):
            worker.handle(cmd)
        got: list[list[object]] = [[], []]
        while worker.engine.has_unfinished():
            worker.step_engine()
            worker.engine.flush_commits()
            step = [received(inbox, 0) for inbox in inboxes]
            assert all(len(frames) <= 1 for frames in step)  # one frame per front end per step, at most
            for k in (0, 1):
                got[k] += step[k]
        zero, one = got
        assert {rid: len(ids) for rid, ids in tokens_by_request(zero).items()} == {"a": 3}
        assert {rid: len(ids) for rid, ids in tokens_by_request(one).items()} == {"b": 3, "c": 3}
        assert any(len(frame.events) == 2 for frame in one if isinstance(frame, TokenBatchEvent))  # b, c together
        assert tokens_by_request(one)["b"] == tokens_by_request(zero)["a"]  # same prompt, greedy
        assert worker.frontend_of == {} and worker.engine.pool.num_free_blocks == NUM_BLOCKS - 1
    finally:
        ctx.destroy(linger=0)


def test_requests_of_a_front_end_that_is_gone_are_aborted_and_free_their_blocks(worker: DecodeWorker) -> None:
    ctx = zmq.Context()
    try:
        inbox = ipc.bind_pull(ctx, ipc.router_addr(worker.run_dir, 0))  # front end 1 is down
        worker.handle(generate("a", 0, max_tokens=6))
        worker.handle(generate("b", 1, max_tokens=6))
        num_steps = 0
        while "b" in worker.frontend_of and num_steps < 3:  # until b's first token found no front end 1
            num_steps += worker.step_engine()
        assert "b" not in worker.engine.requests and set(worker.frontend_of) == {"a"} and worker.num_aborted == 1
        while worker.engine.has_unfinished():
            num_steps += worker.step_engine()
            worker.engine.flush_commits()
        assert {rid: len(ids) for rid, ids in tokens_by_request(received(inbox, num_steps)).items()} == {"a": 6}
        assert worker.engine.pool.num_free_blocks == NUM_BLOCKS - 1 and worker.frontend_of == {}
    finally:
        ctx.destroy(linger=0)


def test_a_prefill_worker_hands_off_nothing_whose_front_end_is_gone(tiny_llama_dir: Path) -> None:
    run_dir = tempfile.mkdtemp(prefix="pdfe")
    ctx = zmq.Context()
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=NUM_BLOCKS), device="cpu")
    router, decode = ipc.bind_pull(ctx, ipc.router_addr(run_dir, 0)), ipc.bind_pull(ctx, ipc.decode_addr(run_dir, 0))
    prefill = PrefillWorker(cfg, 0, run_dir, num_decode=1, transport="shm", num_frontends=2)  # front end 1 is down
    try:
        prefill.handle(generate("a", 0))
        prefill.handle(generate("b", 1))
        while prefill.engine.has_unfinished():
            prefill.step_engine()
        first = {m.request_id for m in received(router, 1) if isinstance(m, TokenEvent)}
        handoffs = {m.request_id for m in received(decode, 1) if isinstance(m, HandoffCmd)}
        assert (first, handoffs, prefill.num_aborted) == ({"a"}, {"a"}, 1)
        assert len(prefill.leases) == 1 and "b" not in prefill.engine.requests and not prefill.pending
    finally:
        prefill.close()
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)
