"""The dist transport (gloo point-to-point, kvtransfer/dist.py): a sink pulls exact blocks from a source's
pool, several pulls and several sinks at once, pulls longer than one message, a refused layout; a sink whose
source is gone gets KVTransferError; which transport a prefill/decode pair takes. (Between real processes:
tests/e2e/test_cluster_dist.py, tests/e2e/test_pair_transport.py; NCCL between two GPUs: tests/gpu/test_two_gpus.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import msgpack
import pytest
import torch

from pdserve.kvtransfer import dist as kvdist
from pdserve.kvtransfer.base import KVTransferError, make_sink, make_source, pair_transport
from pdserve.kvtransfer.layout import KVLayout, LayoutMismatchError
from pdserve.kvtransfer.pool import allocate_kv_pool

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


def test_workers_of_tp_size_above_1_are_refused_before_connecting(source: kvdist.DistSource) -> None:
    message = r"^the dist transport moves KV between workers of TP size 1 only \(decode TP {}, prefill TP {}\)$"
    two = replace(SINK, tp_size=2, tp_rank=1)
    sink = make_sink("dist", allocate_kv_pool(two, "cpu", shared=False), two)
    with pytest.raises(KVTransferError, match=message.format(2, 1)):
        sink.open(0, descriptor(source))
    sink = make_sink("dist", allocate_kv_pool(SINK, "cpu", shared=False), SINK)
    group_fp = replace(LAYOUT, tp_size=2).fingerprint()
    with pytest.raises(KVTransferError, match=message.format(1, 2)):
        sink.open(0, {**descriptor(source), "fingerprint": group_fp})
    with pytest.raises(KVTransferError, match=message.format(1, 2)):
        sink.open(0, descriptor(source), group_fp)
    assert not sink.is_open(0) and source.store.add(kvdist.SESSIONS_KEY, 0) == 0  # no session registered


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
