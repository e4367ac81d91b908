"""The shm transport: a sink maps a source's shared-memory pool and pulls exact blocks, in another process
too, synchronously (every pull handle is done on return); mismatched layouts are refused; closing leaves
nothing in /dev/shm. Also PullHandle itself, on a fake event."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import torch

from pdserve.core.messages import HandshakeEvent, decode, encode
from pdserve.kvtransfer.base import KVTransferError, PullHandle
from pdserve.kvtransfer.factory import make_sink, make_source
from pdserve.kvtransfer.layout import KVLayout, LayoutMismatchError
from pdserve.kvtransfer.pool import SHM_DIR, KVPool, allocate_kv_pool, attach_shm_pool, remove_stale_segments

REPO_ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(model="tiny", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8, num_blocks=32)
SINK_BLOCKS = 20
SRC = [31, 3, 17, 8, 0, 22]
DST = [1, 19, 5, 6, 12, 2]

# Runs in a fresh interpreter: reads a msgpack descriptor on stdin, pulls SRC into DST of its own pool
# (SINK_BLOCKS blocks) and saves that whole pool to argv[1].
SINK_SCRIPT = """
import json, sys
from dataclasses import replace
import msgpack, torch
from pdserve.kvtransfer.factory import make_sink
from pdserve.kvtransfer.layout import FINGERPRINT_FIELDS, KVLayout
from pdserve.kvtransfer.pool import allocate_kv_pool

out, src, dst, num_blocks = sys.argv[1], *map(json.loads, sys.argv[2:5])
desc = msgpack.unpackb(sys.stdin.buffer.read(), raw=False)
layout = KVLayout(**{name: desc["fingerprint"][name] for name in FINGERPRINT_FIELDS}, num_blocks=num_blocks)
local = allocate_kv_pool(layout, "cpu", shared=False)
sink = make_sink("shm", local, layout)
sink.open(0, desc, layout.fingerprint())
assert sink.pull(0, src, dst).done()
sink.close_all()
torch.save(local.tensor, out)
"""


def filled_source(layout: KVLayout, seed: int = 0) -> KVPool:
    pool = allocate_kv_pool(layout, "cpu", shared=True)
    gen = torch.Generator().manual_seed(seed)
    pool.tensor.copy_(torch.randn(layout.shape, generator=gen).to(layout.torch_dtype))
    return pool


@pytest.fixture
def source_pool() -> Iterator[KVPool]:
    pool = filled_source(LAYOUT)
    yield pool
    pool.close()


def local_pool(layout: KVLayout = LAYOUT, num_blocks: int = SINK_BLOCKS) -> KVPool:
    return allocate_kv_pool(replace(layout, num_blocks=num_blocks), "cpu", shared=False)


def assert_pulled(local: torch.Tensor, source: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """local[:, :, dst] == source[:, :, src] exactly; every other local block still zero."""
    assert torch.equal(local[:, :, dst], source[:, :, src])
    untouched = [b for b in range(local.shape[2]) if b not in dst]
    assert not local[:, :, untouched].any()


# --- pools ------------------------------------------------------------------------------------------


def test_shared_pool_is_zeroed_contiguous_with_layer_views(source_pool: KVPool) -> None:
    fresh = allocate_kv_pool(LAYOUT, "cpu", shared=True)
    try:
        assert fresh.tensor.shape == LAYOUT.shape and fresh.tensor.is_contiguous() and not fresh.tensor.any()
        views = fresh.layer_views()
        assert len(views) == LAYOUT.num_layers
        assert views[1].shape == (2, LAYOUT.num_blocks, 4, 2, 8)
        assert views[1].data_ptr() == fresh.tensor[1].data_ptr()
        assert (SHM_DIR / str(fresh.shm_name)).exists()
    finally:
        fresh.close()


def test_close_unlinks_the_segment_and_views_stay_valid(source_pool: KVPool) -> None:
    name = str(source_pool.shm_name)
    expected = source_pool.tensor[2].clone()
    view = source_pool.layer_views()[2]
    source_pool.close()
    source_pool.close()  # idempotent
    assert not (SHM_DIR / name).exists()
    assert torch.equal(view, expected)  # the mapping lives as long as the tensor
    with pytest.raises(FileNotFoundError):
        attach_shm_pool(name, LAYOUT)


def test_shared_pool_lives_on_cpu_only() -> None:
    with pytest.raises(ValueError, match="cuda_ipc"):
        allocate_kv_pool(LAYOUT, "cuda", shared=True)


def test_attach_refuses_names_that_are_not_pool_segments() -> None:
    for name in ("../etc/passwd", "psm_123", "pdserve_kv_/x"):
        with pytest.raises(ValueError, match="not a KV pool segment"):
            attach_shm_pool(name, LAYOUT)


def test_remove_stale_segments_unlinks_only_those_of_dead_creators(source_pool: KVPool) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = SHM_DIR / f"pdserve_kv_{int(dead.stdout)}_00ff"
    stale.write_bytes(b"\0" * 64)
    assert stale.name in remove_stale_segments()
    assert not stale.exists()
    assert (SHM_DIR / str(source_pool.shm_name)).exists()  # ours: this process is alive


# --- source / sink in this process ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_pull_copies_scattered_blocks_of_every_layer(dtype: str) -> None:
    layout = replace(LAYOUT, dtype=dtype)
    source = filled_source(layout, seed=1)
    try:
        local = local_pool(layout)
        sink = make_sink("shm", local, local.layout)
        sink.open(7, make_source("shm", source).descriptor())
        handle = sink.pull(7, SRC, DST)
        assert handle.done()  # synchronous: the blocks are in and the lease may be released
        assert_pulled(local.tensor, source.tensor, SRC, DST)
    finally:
        source.close()


def test_sink_maps_the_pool_rather_than_copying_it_at_open(source_pool: KVPool) -> None:
    local = local_pool()
    sink = make_sink("shm", local, local.layout)
    sink.open(0, make_source("shm", source_pool).descriptor())
    source_pool.tensor[:, :, 9].fill_(3.0)  # written after open
    sink.pull(0, [9], [4])
    assert (local.tensor[:, :, 4] == 3.0).all()


def test_descriptor_travels_in_a_handshake_event(source_pool: KVPool) -> None:
    desc = make_source("shm", source_pool).descriptor()
    assert desc == {
        "transport": "shm",
        "fingerprint": LAYOUT.fingerprint(),
        "ranks": [{"tp_rank": 0, "num_blocks": 32, "shape": [3, 2, 32, 4, 2, 8], "shm_name": source_pool.shm_name}],
    }
    reply = decode(encode(HandshakeEvent(ok=True, pool_id="p", descriptor=desc)))
    assert isinstance(reply, HandshakeEvent) and reply.descriptor == desc


def test_mismatching_fingerprint_is_refused(source_pool: KVPool) -> None:
    desc = make_source("shm", source_pool).descriptor()
    other = local_pool(replace(LAYOUT, block_size=8, dtype="bfloat16"))
    sink = make_sink("shm", other, other.layout)
    message = r"^KV layout mismatch: dtype bfloat16 != float32; block_size 8 != 4$"
    with pytest.raises(LayoutMismatchError, match=message):
        sink.open(0, desc)
    assert not sink.is_open(0)


def test_mismatching_remote_fingerprint_argument_is_refused(source_pool: KVPool) -> None:
    local = local_pool()
    sink = make_sink("shm", local, local.layout)
    remote_fp = replace(LAYOUT, head_dim=4).fingerprint()
    with pytest.raises(LayoutMismatchError, match="head_dim 8 != 4"):
        sink.open(0, make_source("shm", source_pool).descriptor(), remote_fp)
    assert not sink.is_open(0)


def test_open_refuses_other_transport_and_malformed_descriptors(source_pool: KVPool) -> None:
    desc = make_source("shm", source_pool).descriptor()
    local = local_pool()
    sink = make_sink("shm", local, local.layout)
    rank = desc["ranks"][0]
    bad_ranks = [
        {**rank, "shape": [3, 2, 31, 4, 2, 8]},
        {**rank, "num_blocks": True},
        {**rank, "shm_name": "../../etc/passwd"},
        {**rank, "shm_name": "pdserve_kv_gone"},
        {**rank, "tp_rank": 1},
        {**rank, "tp_rank": None},
    ]
    bad = [
        {**desc, "transport": "cuda_ipc"},
        {**desc, "ranks": None},
        {**desc, "ranks": []},
        {**desc, "ranks": [rank, rank]},
        {**desc, "ranks": ["rank 0"]},
        *({**desc, "ranks": [r]} for r in bad_ranks),
    ]
    for d in bad:
        with pytest.raises(KVTransferError):
            sink.open(0, d)
    assert not sink.is_open(0)


def test_pull_refuses_unopened_worker_and_bad_block_ids(source_pool: KVPool) -> None:
    local = local_pool()
    sink = make_sink("shm", local, local.layout)
    with pytest.raises(KVTransferError, match="not open"):
        sink.pull(0, [1], [1])
    sink.open(0, make_source("shm", source_pool).descriptor())
    for src, dst in (([1, 2], [1]), ([32], [1]), ([1], [SINK_BLOCKS]), ([-1], [1]), ([1, 2], [3, 3])):
        with pytest.raises(KVTransferError):
            sink.pull(0, src, dst)
    assert not local.tensor.any()
    assert sink.pull(0, [], []).done()
    sink.close(0)
    with pytest.raises(KVTransferError, match="not open"):
        sink.pull(0, [1], [1])


def test_transports_check_their_pools(source_pool: KVPool) -> None:
    with pytest.raises(KVTransferError, match="shared=True"):
        make_source("shm", local_pool())
    with pytest.raises(KVTransferError, match="CUDA"):
        make_source("cuda_ipc", source_pool)
    with pytest.raises(ValueError, match="unknown KV transport"):
        make_source("rdma", source_pool)


# --- pull handles ---------------------------------------------------------------------------------------


class FakeEvent:
    """Stands in for a torch.cuda.Event: query() is False until the test completes it."""

    def __init__(self) -> None:
        self.complete = False
        self.num_synchronizes = 0

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.num_synchronizes += 1
        self.complete = True


def test_handle_without_event_is_done() -> None:
    handle = PullHandle()
    assert handle.done()
    handle.wait()
    assert handle.done()


def test_handle_is_done_once_its_event_completes_and_then_drops_what_it_kept() -> None:
    event, ids = FakeEvent(), torch.arange(4)
    handle = PullHandle(event, (ids,))  # type: ignore[arg-type]
    assert not handle.done() and not handle.done()
    assert handle._keep_alive == (ids,)  # the copy may still read the ids
    event.complete = True
    assert handle.done()
    assert handle._keep_alive == () and handle._event is None
    assert handle.done()


def test_handle_wait_synchronizes_its_event_once() -> None:
    event = FakeEvent()
    handle = PullHandle(event, (torch.arange(4),))  # type: ignore[arg-type]
    handle.wait()
    handle.wait()
    assert event.num_synchronizes == 1 and handle.done() and handle._keep_alive == ()


# --- a sink in another process --------------------------------------------------------------------


def test_sink_in_another_process_pulls_exact_blocks_and_nothing_leaks(source_pool: KVPool, tmp_path: Path) -> None:
    name = str(source_pool.shm_name)
    desc = make_source("shm", source_pool).descriptor()
    out = tmp_path / "local.pt"
    argv = [sys.executable, "-c", SINK_SCRIPT, str(out), json.dumps(SRC), json.dumps(DST), str(SINK_BLOCKS)]
    proc = subprocess.run(argv, input=msgpack.packb(desc), capture_output=True, cwd=REPO_ROOT, timeout=60)
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    assert "resource_tracker" not in stderr and "leaked" not in stderr
    assert (SHM_DIR / name).exists()  # the sink's exit did not unlink the source's segment
    assert_pulled(torch.load(out), source_pool.tensor, SRC, DST)
    source_pool.close()
    assert not (SHM_DIR / name).exists()
