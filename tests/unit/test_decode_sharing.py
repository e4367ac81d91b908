"""Decode-side block sharing: a handed-off request's full blocks that the decode engine already holds under
the same hashes are shared (refcounted), only the rest are copied, and copied full blocks join the prefix
cache only after their copy was enqueued. Engine level (a prefill engine's KV copied by hand, tokens against
Hugging Face) and worker level (a real DecodeWorker on the tiny llama, CPU, shm transport, in this process).
A decode worker in a cluster with prefill workers also serves a GenerateCmd itself, first token included.
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
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.engine import Adoption, Engine
from pdserve.core.messages import (
    GenerateCmd,
    HandoffCmd,
    ReleaseCmd,
    Sampling,
    Timings,
    TokenBatchEvent,
    TokenEvent,
    pack_token_ids,
)
from pdserve.core.request import Request
from pdserve.core.sampler import SamplingState
from pdserve.core.sampling_params import SamplingParams
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.kvtransfer.base import KVTransferError, PullHandle
from pdserve.kvtransfer.factory import make_source
from pdserve.kvtransfer.pool import KVPool, allocate_kv_pool
from pdserve.kvtransfer.shm import ShmSink
from tests.hf_reference import hf_greedy, random_prompts
from tests.unit.test_decode_worker_release import received

BS = 16
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# A 3-block prefix and continuations: A and B end in a partial block, C is the prefix alone (block-aligned),
# D has a 4th full block of its own.
PREFIX, TAIL_A, TAIL_B, TAIL_D = random_prompts(1024, (3 * BS, 5, 3, BS + 4), seed=21)
PROMPT_A, PROMPT_B, PROMPT_C, PROMPT_D = PREFIX + TAIL_A, PREFIX + TAIL_B, PREFIX, PREFIX + TAIL_D


def engine_for(model_dir: Path, num_blocks: int) -> Engine:
    cache = CacheConfig(block_size=BS, num_blocks=num_blocks)
    return Engine(EngineConfig(ModelConfig.from_pretrained(model_dir), cache))


def prefilled(prefill: Engine, request_id: str, prompt: list[int]) -> Request:
    """Run prompt's prefill on the prefill engine and detach it with its first token."""
    prefill.add_request(request_id, prompt, GREEDY)
    (out,) = prefill.step()
    assert out.request_id == request_id and out.num_output_tokens == 1
    return prefill.detach(request_id)


def adopt(decode: Engine, req: Request) -> Adoption | None:
    state = SamplingState(req.sampling.params, req.sampling.eos_token_ids, req.sampling.num_generated)
    return decode.adopt(req.request_id, req.token_ids, req.num_prompt_tokens, state)


def hand_off(prefill: Engine, decode: Engine, request_id: str, prompt: list[int]) -> Adoption:
    """Prefill, adopt, copy the blocks the decode engine lacks, start it (caches them), release the prefill
    blocks."""
    req = prefilled(prefill, request_id, prompt)
    dst = adopt(decode, req)
    assert dst is not None
    decode.runner.kv_pool[:, :, dst.dst] = prefill.runner.kv_pool[:, :, dst.sources(req.block_ids)]
    decode.start_adopted(request_id)
    prefill.release_blocks(req.block_ids)
    return dst


def fake_request(request_id: str, prompt: list[int]) -> Request:
    """A handed-off request whose KV is never read (the test only checks blocks)."""
    state = SamplingState(GREEDY, (), num_generated=1)
    return Request(request_id, [*prompt, 7], len(prompt), state)


def decode_all(decode: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {rid: [] for rid in decode.requests}
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def test_second_handoff_shares_the_cached_prefix_and_copies_only_the_rest(tiny_llama_dir: Path) -> None:
    prefill, decode = engine_for(tiny_llama_dir, 32), engine_for(tiny_llama_dir, 16)
    first: dict[str, int] = {}
    dst_a = hand_off(prefill, decode, "a", PROMPT_A)
    assert tuple(dst_a) == ([1, 2, 3, 4], 0)
    first["a"] = decode.requests["a"].token_ids[-1]
    dst_b = hand_off(prefill, decode, "b", PROMPT_B)
    first["b"] = decode.requests["b"].token_ids[-1]
    assert tuple(dst_b) == ([5], 3)  # only B's partial tail block is copied
    assert decode.requests["b"].block_ids == [1, 2, 3, 5]
    assert [decode.pool.ref_cnt(b) for b in range(1, 6)] == [2, 2, 2, 1, 1]
    assert decode.pool.num_cached_blocks == 3  # the partial tails stay private

    rest = decode_all(decode)
    got = [[first[rid], *rest[rid]] for rid in ("a", "b")]
    assert got == hf_greedy(tiny_llama_dir, [PROMPT_A, PROMPT_B], MAX_TOKENS)
    assert decode.stats.num_prefill_tokens_computed == 0
    assert decode.pool.num_used_blocks == 0 and decode.pool.num_free_blocks == 15  # 0 leaked


def test_block_aligned_handoff_with_every_block_cached_copies_nothing(tiny_llama_dir: Path) -> None:
    prefill, decode = engine_for(tiny_llama_dir, 32), engine_for(tiny_llama_dir, 16)
    hand_off(prefill, decode, "a", PROMPT_A)
    dst_c = hand_off(prefill, decode, "c", PROMPT_C)
    assert tuple(dst_c) == ([], 3)
    first_c = decode.requests["c"].token_ids[-1]
    rest = decode_all(decode)  # C's first decode step gets a fresh 4th block: the shared ones are full
    assert [first_c, *rest["c"]] == hf_greedy(tiny_llama_dir, [PROMPT_C], MAX_TOKENS)[0]
    assert decode.pool.num_used_blocks == 0


def test_failed_copy_leaves_no_block_findable_under_its_hash(tiny_llama_dir: Path) -> None:
    prefill, decode = engine_for(tiny_llama_dir, 32), engine_for(tiny_llama_dir, 16)
    hand_off(prefill, decode, "a", PROMPT_A)
    cached_before = decode.pool.num_cached_blocks
    dst_d = adopt(decode, fake_request("d", PROMPT_D))
    assert dst_d is not None and tuple(dst_d) == ([5, 6], 3)  # a 4th full block + the tail
    decode.abort("d")  # the pull raised: the worker aborts it without starting it
    assert decode.pool.num_cached_blocks == cached_before == 3
    assert decode.pool.lookup(hash_full_blocks(PROMPT_D, BS)[3]) is None
    assert [decode.pool.ref_cnt(b) for b in range(1, 7)] == [1, 1, 1, 1, 0, 0]
    dst_again = adopt(decode, fake_request("d2", PROMPT_D))
    assert dst_again is not None and dst_again.num_shared == 3  # the 4th block is copied again


def test_room_check_counts_free_cached_blocks_once(tiny_llama_dir: Path) -> None:
    prefill, decode = engine_for(tiny_llama_dir, 32), engine_for(tiny_llama_dir, 8)  # 7 usable blocks
    hand_off(prefill, decode, "a", PROMPT_A)  # blocks 1..4, 1..3 cached
    decode.abort("a")
    assert decode.pool.free_block_ids() == [5, 6, 7, 4, 3, 2, 1]
    assert adopt(decode, fake_request("filler", random_prompts(1024, (2 * BS + 1,), seed=5)[0])) == ([5, 6, 7], 0)
    # D needs its 3 cached (free) blocks plus 2 new; only 1 free block is not one of them.
    assert adopt(decode, fake_request("d", PROMPT_D)) is None
    assert decode.pool.free_block_ids() == [4, 3, 2, 1] and "d" not in decode.requests
    dst_b = adopt(decode, fake_request("b", PROMPT_B))
    assert dst_b is not None and tuple(dst_b) == ([4], 3)
    assert decode.requests["b"].block_ids == [1, 2, 3, 4] and decode.pool.num_free_blocks == 0


# ---- worker level ----

POOL_ID = "pool-a"


class Harness(NamedTuple):
    worker: DecodeWorker
    source: KVPool  # prefill worker 0's pool, random contents
    prefill: zmq.Socket  # what prefill worker 0 receives
    router: zmq.Socket  # what the router receives


class RecordingSink(ShmSink):
    """Records pulls and copies nothing; raises while fail is set."""

    def __init__(self, sink: ShmSink) -> None:
        super().__init__(sink.local_pool, sink.layout)
        self.pulls: list[tuple[list[int], list[int]]] = []
        self.fail = False

    def pull(self, prefill_worker: int, src_block_ids: list[int], dst_block_ids: list[int]) -> PullHandle:
        if self.fail:
            raise KVTransferError("mapping lost")
        self.pulls.append((list(src_block_ids), list(dst_block_ids)))
        return PullHandle()


@pytest.fixture
def harness(tiny_llama_dir: Path) -> Iterator[Harness]:
    run_dir = tempfile.mkdtemp(prefix="pdshr")  # NOTE: short: ipc:// paths are limited to ~100 bytes
    ctx = zmq.Context()
    prefill = ipc.bind_pull(ctx, ipc.prefill_addr(run_dir, 0))
    router = ipc.bind_pull(ctx, ipc.router_addr(run_dir))
    cache = CacheConfig(block_size=BS, num_blocks=24)
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), cache, device="cpu")
    worker = DecodeWorker(cfg, 0, run_dir, num_prefill=1, transport="shm")
    source = allocate_kv_pool(replace(worker.layout, num_blocks=16), "cpu", shared=True)
    source.tensor.copy_(torch.randn(source.layout.shape, generator=torch.Generator().manual_seed(0)))
    worker.sinks["shm"].open(0, make_source("shm", source).descriptor())
    worker.peers[0] = POOL_ID  # the handshake with prefill worker 0 is done
    worker.sink_of[0] = worker.sinks["shm"]
    try:
        yield Harness(worker, source, prefill, router)
    finally:
        worker.close()
        source.close()
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


def handoff(request_id: str, lease_id: int, prompt: list[int], block_ids: list[int]) -> HandoffCmd:
    sampling = Sampling(temperature=0.0, max_tokens=4, ignore_eos=True, num_generated=1)
    return HandoffCmd(
        request_id, 0, POOL_ID, lease_id, block_ids, pack_token_ids([*prompt, 21]), len(prompt), 0, sampling, Timings()
    )


def recording_sink(worker: DecodeWorker) -> RecordingSink:
    sink = worker.sink_of[0]
    assert isinstance(sink, ShmSink)
    worker.sink_of[0] = wrapped = RecordingSink(sink)
    return wrapped


def test_decode_worker_pulls_only_the_blocks_it_does_not_hold(harness: Harness) -> None:
    worker, source = harness.worker, harness.source
    worker.handle(handoff("a", 1, PROMPT_A, [11, 2, 5, 7]))
    assert (worker.counters()["blocks_pulled"], worker.counters()["blocks_shared"]) == (4, 0)
    worker.handle(handoff("b", 2, PROMPT_B, [12, 13, 14, 9]))
    assert (worker.counters()["blocks_pulled"], worker.counters()["blocks_shared"]) == (5, 3)
    assert received(harness.prefill, 2) == [ReleaseCmd(0, [1], POOL_ID), ReleaseCmd(0, [2], POOL_ID)]
    blocks_a, blocks_b = worker.engine.requests["a"].block_ids, worker.engine.requests["b"].block_ids
    assert blocks_b[:3] == blocks_a[:3] and blocks_b[3] not in blocks_a
    assert worker.kv_pool is not None
    assert torch.equal(worker.kv_pool.tensor[:, :, blocks_a], source.tensor[:, :, [11, 2, 5, 7]])
    assert torch.equal(worker.kv_pool.tensor[:, :, blocks_b[3]], source.tensor[:, :, 9])


def test_fully_shared_handoff_pulls_nothing_and_releases_its_lease_at_once(harness: Harness) -> None:
    worker = harness.worker
    worker.handle(handoff("a", 1, PROMPT_A, [11, 2, 5, 7]))
    sink = recording_sink(worker)
    worker.handle(handoff("c", 2, PROMPT_C, [12, 13, 14]))
    assert sink.pulls == [] and worker.counters()["releases_pending"] == 0
    assert (worker.counters()["blocks_pulled"], worker.counters()["blocks_shared"]) == (4, 3)
    assert received(harness.prefill, 2) == [ReleaseCmd(0, [1], POOL_ID), ReleaseCmd(0, [2], POOL_ID)]


def test_failed_pull_caches_none_of_the_request_blocks(harness: Harness) -> None:
    worker = harness.worker
    sink = recording_sink(worker)
    sink.fail = True
    worker.handle(handoff("d", 1, PROMPT_D, [11, 2, 5, 7, 8]))
    assert not worker.engine.has_unfinished() and worker.engine.pool.num_cached_blocks == 0
    assert worker.counters()["blocks_pulled"] == 0
    assert received(harness.prefill, 1) == [ReleaseCmd(0, [1], POOL_ID)]


def test_generate_cmd_is_served_with_its_first_token_in_a_cluster_with_prefill_workers(
    harness: Harness, tiny_llama_dir: Path
) -> None:
    worker = harness.worker
    assert worker.to_prefill  # a disaggregated cluster
    sampling = Sampling(temperature=0.0, max_tokens=4, ignore_eos=True)
    worker.handle(GenerateCmd("g", pack_token_ids(PROMPT_B), sampling, decode_worker=0, timings=Timings(arrival=1.0)))
    while worker.engine.has_unfinished():
        worker.step_engine()
    batches = received(harness.router, 1)
    events = [e for batch in batches if isinstance(batch, TokenBatchEvent) for e in batch.events]
    assert all(isinstance(e, TokenEvent) and e.request_id == "g" for e in events)
    assert events[0].index == 0 and events[0].timings is not None and events[0].timings.first_token > 0
    assert [e.index for e in events] == list(range(len(events)))
    assert [t for e in events for t in e.token_ids] == hf_greedy(tiny_llama_dir, [PROMPT_B], 4)[0]
    assert events[-1].finish_reason == "length"
    assert worker.engine.stats.num_prefill_tokens_computed == len(PROMPT_B)
