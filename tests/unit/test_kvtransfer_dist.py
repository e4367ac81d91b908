"""The dist transport (gloo point-to-point, kvtransfer/dist.py): a sink pulls exact blocks from a source's
pool, several pulls and several sinks at once, pulls longer than one message, a refused layout; a sink whose
source is gone gets KVTransferError; between TP groups each decode rank pulls exactly its KV heads over one
session per prefill rank it reads, and the source sends only the heads a header names; which transport a
prefill/decode pair takes, and which sources each rank of a prefill worker opens. (Between real processes:
tests/e2e/test_cluster_dist.py, tests/e2e/test_pair_transport.py; NCCL between two GPUs: tests/gpu/test_two_gpus.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import torch

from pdserve.core import ipc
from pdserve.kvtransfer import dist as kvdist
from pdserve.kvtransfer.base import KVTransferError, KVTransferSink, Segment, merge_descriptors, plan_segments
from pdserve.kvtransfer.factory import make_sink, make_source, pair_transport
from pdserve.kvtransfer.layout import KVLayout, LayoutMismatchError, kv_head_ranges
from pdserve.kvtransfer.pool import allocate_kv_pool
from pdserve.prefill_worker.worker import pair_kinds, source_kinds

LAYOUT = KVLayout(model="tiny", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8, num_blocks=32)
SINK = replace(LAYOUT, num_blocks=20)


@pytest.fixture
def source() -> Iterator[kvdist.DistSource]:
    pool = allocate_kv_pool(LAYOUT, "cpu", shared=False)
    pool.tensor.copy_(torch.randn(LAYOUT.shape))
    src = make_source("dist", pool)
    assert isinstance(src, kvdist.DistSource)
    yield src
    src.close()


def descriptor(source: kvdist.DistSource) -> dict:
    return msgpack.unpackb(msgpack.packb(source.descriptor()), raw=False)  # NOTE: as it travels


def test_pulls_copy_exact_blocks_for_several_sinks(source: kvdist.DistSource) -> None:
    sinks = [make_sink("dist", allocate_kv_pool(SINK, "cpu", shared=False), SINK) for _ in range(2)]
    for i, sink in enumerate(sinks):
        sink.open(0, descriptor(source))
        src, dst = [31, 3 + i, 17, 0], [1, 19, 5, 6]
        assert sink.pull(0, src, dst).done()
        got = sink.local_pool.tensor
        assert torch.equal(got[:, :, dst], source.pool.tensor[:, :, src])
        assert not got[:, :, [b for b in range(20) if b not in dst]].any()
    for sink in sinks:
        sink.close_all()


def test_a_pull_longer_than_one_message_is_split(source: kvdist.DistSource, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = make_sink("dist", allocate_kv_pool(SINK, "cpu", shared=False), SINK)
    sink.open(0, descriptor(source))
    monkeypatch.setattr(kvdist, "MAX_BLOCKS_PER_MESSAGE", 3)
    src, dst = list(range(10, 17)), list(range(1, 8))
    sink.pull(0, src, dst)
    assert torch.equal(sink.local_pool.tensor[:, :, dst], source.pool.tensor[:, :, src])
    sink.close_all()


def test_a_mismatched_layout_is_refused_before_connecting(source: kvdist.DistSource) -> None:
    other = replace(SINK, dtype="bfloat16")
    sink = make_sink("dist", allocate_kv_pool(other, "cpu", shared=False), other)
    with pytest.raises(LayoutMismatchError, match="dtype bfloat16 != float32"):
        sink.open(0, descriptor(source))


def test_an_unreachable_source_is_a_transfer_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvdist, "TIMEOUT", kvdist.datetime.timedelta(seconds=1))
    sink = make_sink("dist", allocate_kv_pool(SINK, "cpu", shared=False), SINK)
    rank = {"tp_rank": 0, "num_blocks": 32, "shape": list(LAYOUT.shape)}
    desc = {"transport": "dist", "fingerprint": LAYOUT.fingerprint()}
    with pytest.raises(KVTransferError, match="cannot reach the KV source"):
        sink.open(0, {**desc, "ranks": [{**rank, "host": "127.0.0.1", "port": 1, "device_type": "cpu"}]})


def test_a_cuda_source_is_refused_by_a_cpu_sink(source: kvdist.DistSource) -> None:
    """NCCL carries the blocks of a CUDA pool: they cannot be received into a CPU pool (nor the reverse)."""
    sink = make_sink("dist", allocate_kv_pool(SINK, "cpu", shared=False), SINK)
    desc = descriptor(source)
    with pytest.raises(KVTransferError, match="a cuda pool cannot be pulled into a cpu pool"):
        sink.open(0, {**desc, "ranks": [{**desc["ranks"][0], "device_type": "cuda"}]})
    assert desc["ranks"][0]["device_type"] == "cpu"


def test_the_descriptor_is_a_group_of_one_rank(source: kvdist.DistSource) -> None:
    desc = descriptor(source)
    assert desc["transport"] == "dist" and desc["fingerprint"] == LAYOUT.fingerprint()
    assert desc["ranks"] == [
        {"tp_rank": 0, "num_blocks": 32, "shape": list(LAYOUT.shape), "host": "127.0.0.1",
         "port": source.store.port, "device_type": "cpu"}
    ]  # fmt: skip


# --- between TP groups: each decode rank pulls exactly its heads, from the prefill ranks holding them ----------

GROUP = replace(LAYOUT, num_kv_heads=4)
"""The model's pool as one rank would hold it: 4 KV heads."""
SRC, DST = [31, 3, 17, 8, 0, 22], [1, 19, 5, 6, 12, 2]


@pytest.fixture
def prefill_group(request: pytest.FixtureRequest) -> Iterator[tuple[torch.Tensor, list[kvdist.DistSource]]]:
    """(full pool [num_layers, 2, num_blocks, block_size, 4, head_dim], the dist sources of a prefill group of TP
    p holding its heads, rank order), p = request.param."""
    p = request.param
    full = torch.randn(GROUP.shape, generator=torch.Generator().manual_seed(p))
    sources = []
    try:
        for r in range(p):
            pool = allocate_kv_pool(replace(GROUP, tp_size=p, tp_rank=r), "cpu", shared=False)
            first, count = pool.layout.heads
            pool.tensor.copy_(full[:, :, :, :, first : first + count])
            sources.append(kvdist.DistSource(pool))
        yield full, sources
    finally:
        for source in sources:
            source.close()


def group_descriptor(sources: list[kvdist.DistSource]) -> dict:
    merged = merge_descriptors([source.descriptor() for source in reversed(sources)])
    return msgpack.unpackb(msgpack.packb(merged), raw=False)  # NOTE: as it travels


def decode_rank(d: int, r: int) -> KVTransferSink:
    layout = replace(GROUP, num_blocks=20, tp_size=d, tp_rank=r)
    return make_sink("dist", allocate_kv_pool(layout, "cpu", shared=False), layout)


def num_sessions(source: kvdist.DistSource) -> int:
    return source.store.add(kvdist.SESSIONS_KEY, 0)


@pytest.mark.parametrize(
    ("prefill_group", "d"), [(2, 1), (1, 2), (2, 2)], indirect=["prefill_group"], ids=["p2d1", "p1d2", "p2d2"]
)
def test_every_decode_rank_pulls_exactly_its_heads(
    prefill_group: tuple[torch.Tensor, list[kvdist.DistSource]], d: int
) -> None:
    full, sources = prefill_group
    desc = group_descriptor(sources)
    sinks = [decode_rank(d, r) for r in range(d)]
    for sink in sinks:
        before = [num_sessions(source) for source in sources]
        sink.open(7, desc, sources[0].fingerprint())
        read = {s.rank for s in plan_segments(sink.layout, kv_head_ranges(desc["fingerprint"]))}
        assert set(sink._remotes[7].ranks) == read  # one session with each prefill rank read, no other
        assert [num_sessions(s) - n for s, n in zip(sources, before, strict=True)] == [
            int(rank in read) for rank in range(len(sources))
        ]
        assert sink.pull(7, SRC, DST).done()
        first, count = sink.layout.heads
        local = sink.local_pool.tensor
        assert torch.equal(local[:, :, DST], full[:, :, SRC, :, first : first + count])
        assert not local[:, :, [b for b in range(20) if b not in DST]].any()
    for sink in sinks:
        sink.close_all()


@pytest.mark.parametrize("prefill_group", [2], indirect=True, ids=["p2"])
def test_a_long_pull_from_a_group_is_split_per_segment(
    prefill_group: tuple[torch.Tensor, list[kvdist.DistSource]], monkeypatch: pytest.MonkeyPatch
) -> None:
    full, sources = prefill_group
    sink = decode_rank(1, 0)
    sink.open(0, group_descriptor(sources))
    monkeypatch.setattr(kvdist, "MAX_BLOCKS_PER_MESSAGE", 4)
    src, dst = list(range(10, 19)), list(range(1, 10))
    assert sink.pull(0, src, dst).done()
    assert torch.equal(sink.local_pool.tensor[:, :, dst], full[:, :, src])
    sink.close_all()


def test_the_source_sends_the_heads_and_blocks_a_header_names(source: kvdist.DistSource) -> None:
    pool = source.pool.tensor
    header = kvdist._header([31, 2], Segment(rank=0, src_head=1, dst_head=0, num_heads=1))
    blocks = source._gather(header)
    assert blocks.is_contiguous() and torch.equal(blocks, pool[:, :, [31, 2], :, 1:2])
    for segment, ids in [(Segment(0, 1, 0, 2), [3]), (Segment(0, 0, 0, 0), [3]), (Segment(0, 0, 0, 1), [32])]:
        with pytest.raises(KVTransferError, match="a request for 1 blocks of heads"):
            source._gather(kvdist._header(ids, segment))


def test_every_rank_of_a_prefill_worker_opens_the_kinds_of_its_pairs(tmp_path: Path) -> None:
    """Ranks > 0 compute the pairs' kinds from the same flags and topology as rank 0 (prefill_worker/worker.py)."""
    topology = {"router": "10.0.0.1", "prefill": ["10.0.0.1", "10.0.0.2"], "decode": ["10.0.0.1", "10.0.0.2"]}
    (tmp_path / ipc.TOPOLOGY_FILE).write_text(json.dumps(topology))
    run_dir, cpu = str(tmp_path), torch.device("cpu")
    assert pair_kinds("auto", run_dir, 0, 2, cpu) == ["shm", "dist"]
    assert pair_kinds("auto", run_dir, 1, 2, torch.device("cuda")) == ["dist", "cuda_ipc"]
    assert source_kinds("auto", ["shm", "dist", "shm"]) == ["shm", "dist"]
    assert source_kinds("dist", pair_kinds("dist", run_dir, 0, 2, cpu)) == ["dist"]
    assert pair_kinds("auto", str(tmp_path / "one-host"), 0, 2, cpu) == ["shm", "shm"]


@pytest.mark.parametrize(
    ("choice", "same_host", "device", "expected"),
    [
        ("auto", True, "cpu", "shm"),
        ("auto", True, "cuda", "cuda_ipc"),
        ("auto", False, "cpu", "dist"),
        ("auto", False, "cuda", "dist"),
        ("dist", True, "cuda", "dist"),
        ("shm", False, "cpu", "shm"),
    ],
)
def test_pair_transport_picks_by_host_unless_forced(choice: str, same_host: bool, device: str, expected: str) -> None:
    assert pair_transport(choice, same_host, torch.device(device)) == expected


def test_pair_transport_rejects_unknown_choices() -> None:
    with pytest.raises(ValueError, match="unknown KV transport 'nixl'"):
        pair_transport("nixl", True, torch.device("cpu"))
