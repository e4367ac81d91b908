"""The cuda_ipc transport: a sink in another process (spawned) maps the source's pool by CUDA IPC handle
and pulls exact blocks, on the same GPU and, with two GPUs, across them; between TP groups (prefill TP 2 ->
decode TP 1, TP 1 -> TP 2) each decode rank maps the prefill ranks holding its KV heads and pulls exactly
those heads; mismatched layouts are refused. Pulls are asynchronous: pull returns before the copy has run, the
copy runs after the work queued on the current stream and beside what is queued there later (a decode step
never waits for it), and the handle becomes done."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import torch

from pdserve.core.messages import HandshakeEvent, decode, encode
from pdserve.kvtransfer.base import merge_descriptors
from pdserve.kvtransfer.cuda_ipc import CudaIpcSink
from pdserve.kvtransfer.factory import make_sink, make_source
from pdserve.kvtransfer.layout import FINGERPRINT_FIELDS, KVLayout, LayoutMismatchError
from pdserve.kvtransfer.pool import KVPool, allocate_kv_pool

pytestmark = pytest.mark.gpu
LAYOUT = KVLayout(
    model="tiny", dtype="float32", block_size=16, num_layers=4, num_kv_heads=2, head_dim=64, num_blocks=64
)
SINK_BLOCKS = 40
SRC = [63, 3, 17, 8, 0, 22, 41]
DST = [1, 39, 5, 6, 12, 2, 30]
TIMEOUT_S = 120


def _sink_main(handshake_frame: bytes, device: str, conn: Connection, tp_size: int = 1, tp_rank: int = 0) -> None:
    """Spawned: decode the HandshakeEvent frame, open its descriptor as rank tp_rank of a decode group of
    tp_size, pull SRC into DST of a fresh pool on device, send that pool back."""
    try:
        reply = decode(handshake_frame)
        assert isinstance(reply, HandshakeEvent)
        desc = reply.descriptor
        fields = {name: desc["fingerprint"][name] for name in FINGERPRINT_FIELDS}
        layout = KVLayout(**fields, num_blocks=SINK_BLOCKS, tp_size=tp_size, tp_rank=tp_rank)
        local = allocate_kv_pool(layout, device, shared=False)
        sink = make_sink("cuda_ipc", local, layout)
        sink.open(0, desc, layout.fingerprint())
        sink.pull(0, SRC, DST).wait()
        pulled = local.tensor.float().cpu().numpy()
        sink.close_all()
        conn.send(("ok", pulled))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_sink(desc: dict[str, Any], device: str, tp_size: int = 1, tp_rank: int = 0) -> np.ndarray:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    frame = encode(HandshakeEvent(ok=True, pool_id="p", descriptor=desc))  # the descriptor's real wire trip
    proc = ctx.Process(target=_sink_main, args=(frame, device, send, tp_size, tp_rank), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(TIMEOUT_S):
            pytest.fail(f"sink process sent nothing in {TIMEOUT_S} s")
        status, payload = recv.recv()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert status == "ok", payload
    return payload  # type: ignore[no-any-return]


def filled_source(layout: KVLayout, device: str) -> KVPool:
    pool = allocate_kv_pool(layout, device, shared=False)
    gen = torch.Generator(device=device).manual_seed(0)
    pool.tensor.copy_(torch.randn(layout.shape, generator=gen, device=device).to(layout.torch_dtype))
    torch.cuda.synchronize(device)  # NOTE: a source announces blocks only once they are written
    return pool


def check_pull(dtype: str, source_device: str, sink_device: str) -> None:
    source = filled_source(replace(LAYOUT, dtype=dtype), source_device)
    pulled = torch.from_numpy(run_sink(make_source("cuda_ipc", source).descriptor(), sink_device))
    expected = source.tensor.float().cpu()
    assert torch.equal(pulled[:, :, DST], expected[:, :, SRC])
    untouched = [b for b in range(SINK_BLOCKS) if b not in DST]
    assert not pulled[:, :, untouched].any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pull_across_processes_on_one_gpu(dtype: str) -> None:
    check_pull(dtype, "cuda:0", "cuda:0")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pull_from_another_gpu(dtype: str) -> None:
    check_pull(dtype, "cuda:0", "cuda:1")


def test_descriptor_is_plain_values() -> None:
    desc = make_source("cuda_ipc", allocate_kv_pool(LAYOUT, "cuda:0", shared=False)).descriptor()
    (rank,) = desc["ranks"]
    assert desc["transport"] == "cuda_ipc" and rank["shape"] == list(LAYOUT.shape) and rank["tp_rank"] == 0
    assert rank["device_uuid"] == str(torch.cuda.get_device_properties(0).uuid)
    assert isinstance(rank["handle"], bytes) and isinstance(rank["event_sync_required"], bool)
    # NOTE: this export is never opened, so torch keeps its IPC reference until exit and may warn there.


def test_mismatching_fingerprint_is_refused_before_mapping() -> None:
    desc = {"transport": "cuda_ipc", "fingerprint": LAYOUT.fingerprint()}  # no handle: never reached
    other = replace(LAYOUT, dtype="bfloat16", num_blocks=SINK_BLOCKS)
    sink = make_sink("cuda_ipc", allocate_kv_pool(other, "cuda:0", shared=False), other)
    with pytest.raises(LayoutMismatchError, match="dtype bfloat16 != float32"):
        sink.open(0, desc)
    assert not sink.is_open(0)


# --- asynchronous pulls (in this process: CUDA IPC cannot map its own exports) ---------------------------

SLEEP_CYCLES = 2_000_000_000
"""GPU spin (~1 s at 2 GHz) queued before a pull: the copy cannot start before it ends."""


class InProcessSink(CudaIpcSink):
    """A cuda_ipc sink whose 'remote' pools are tensors of this process, by tp_rank; open and pull are the real
    ones."""

    def __init__(self, local_pool: KVPool, remotes: dict[int, torch.Tensor]) -> None:
        super().__init__(local_pool, local_pool.layout)
        self.remotes = remotes
        self.attached: list[int] = []

    def _attach(self, entry: dict[str, Any], remote_layout: KVLayout) -> torch.Tensor:
        remote = self.remotes[entry["tp_rank"]]
        assert tuple(remote.shape) == remote_layout.shape
        self.attached.append(entry["tp_rank"])
        return remote


def open_in_process(source: KVPool) -> tuple[InProcessSink, KVPool]:
    local = allocate_kv_pool(replace(source.layout, num_blocks=SINK_BLOCKS), "cuda:0", shared=False)
    sink = InProcessSink(local, {0: source.tensor})
    layout = source.layout
    rank = {"tp_rank": 0, "num_blocks": layout.num_blocks, "shape": list(layout.shape)}
    sink.open(0, {"transport": "cuda_ipc", "fingerprint": layout.fingerprint(), "ranks": [rank]})
    return sink, local


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pull_returns_before_the_copy_which_follows_earlier_work_on_the_current_stream(dtype: str) -> None:
    source = filled_source(replace(LAYOUT, dtype=dtype), "cuda:0")
    sink, local = open_in_process(source)
    sink.pull(0, SRC, DST).wait()  # warm-up: compiles the kernel, caches pinned memory
    local.tensor.zero_()  # on the current stream, before the sleep: a copy not ordered after it would be wiped
    torch.cuda._sleep(SLEEP_CYCLES)  # on the current stream; the sink's stream waits for it
    start = time.perf_counter()
    handle = sink.pull(0, SRC, DST)
    elapsed = time.perf_counter() - start
    assert not handle.done(), f"pull returned after the copy ({elapsed * 1e3:.1f} ms): the host waited"
    handle.wait()
    pulled = local.tensor.float().cpu()
    expected = source.tensor.float().cpu()
    assert torch.equal(pulled[:, :, DST], expected[:, :, SRC])
    untouched = [b for b in range(SINK_BLOCKS) if b not in DST]
    assert not pulled[:, :, untouched].any()


def test_work_queued_after_a_pull_does_not_wait_for_its_copy() -> None:
    """What the decode steps queue after a pull runs beside its copy: with the sink's stream held up, the current
    stream drains while the copy has not run; the copy then lands exact."""
    source = filled_source(LAYOUT, "cuda:0")
    sink, local = open_in_process(source)
    sink.pull(0, SRC, DST).wait()  # warm-up
    local.tensor.zero_()
    torch.cuda.current_stream().synchronize()
    with torch.cuda.stream(sink._stream(local.device)):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copy queues behind this
    handle = sink.pull(0, SRC, DST)
    step = torch.ones(1, device="cuda:0") * 2  # a "decode step" queued after the pull
    torch.cuda.current_stream().synchronize()
    assert not handle.done(), "the current stream waited for the copy"
    assert step.item() == 2
    handle.wait()
    assert torch.equal(local.tensor[:, :, DST].float().cpu(), source.tensor[:, :, SRC].float().cpu())


def test_pull_handle_becomes_done_by_polling_and_the_blocks_are_exact() -> None:
    """A larger pull (every block of a 32-layer pool, 21 MB) with nothing gating it: done() turns True by
    polling alone, and then every block is there."""
    layout = replace(LAYOUT, num_blocks=SINK_BLOCKS, num_layers=32)
    source = filled_source(layout, "cuda:0")
    sink, local = open_in_process(source)
    src, dst = list(range(SINK_BLOCKS))[::-1], list(range(SINK_BLOCKS))
    handle = sink.pull(0, src, dst)
    deadline = time.monotonic() + 30
    while not handle.done():
        assert time.monotonic() < deadline, "the copy's event never completed"
        time.sleep(0.001)
    assert torch.equal(local.tensor, source.tensor.flip(2))


# --- TP groups ----------------------------------------------------------------------------------------------

TP_LAYOUT = replace(LAYOUT, num_kv_heads=4, head_dim=32)


def full_pool(dtype: str) -> torch.Tensor:
    """Random blocks of every KV head of the model [num_layers, 2, num_blocks, block_size, 4, head_dim] (CPU)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(TP_LAYOUT.shape, generator=gen).to(replace(TP_LAYOUT, dtype=dtype).torch_dtype)


def prefill_group(full: torch.Tensor, tp_size: int, dtype: str) -> list[KVPool]:
    """The pools of a prefill group of tp_size on cuda:0, each rank holding its heads of full."""
    pools = []
    for r in range(tp_size):
        pool = allocate_kv_pool(replace(TP_LAYOUT, dtype=dtype, tp_size=tp_size, tp_rank=r), "cuda:0", shared=False)
        first, count = pool.layout.heads
        pool.tensor.copy_(full[:, :, :, :, first : first + count])
        pools.append(pool)
    torch.cuda.synchronize()  # NOTE: a source announces blocks only once they are written
    return pools


def group_descriptor(pools: list[KVPool]) -> dict[str, Any]:
    """The prefill worker's handshake descriptor: every rank's export (the real one), merged."""
    return merge_descriptors([make_source("cuda_ipc", pool).descriptor() for pool in pools])


def expected_heads(full: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """The blocks SRC of full, restricted to layout's heads, as a decode rank holds them after the pull."""
    first, count = layout.heads
    return full[:, :, SRC, :, first : first + count]


ATTACHED = {(2, 1): [[0, 1]], (1, 2): [[0], [0]], (2, 2): [[0], [1]]}
"""(prefill TP, decode TP) -> the prefill ranks each decode rank maps (4 KV heads)."""


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize(("p", "d"), list(ATTACHED))
@pytest.mark.parametrize(("dtype", "staged"), [("bfloat16", False), ("float32", False), ("bfloat16", True)])
def test_decode_ranks_pull_their_heads_from_a_prefill_group_in_process(
    p: int, d: int, dtype: str, staged: bool
) -> None:
    """Source export and group descriptor, sink open (segment planning, one mapping per rank used) and pull:
    each decode rank's pool is bit-exact with its heads of the blocks. staged: through the torch path taken
    without peer access (gather, cross, scatter into a head slice) instead of the kernel."""
    full = full_pool(dtype)
    pools = prefill_group(full, p, dtype)
    desc = group_descriptor(pools)
    for r in range(d):
        layout = replace(TP_LAYOUT, dtype=dtype, num_blocks=SINK_BLOCKS, tp_size=d, tp_rank=r)
        local = allocate_kv_pool(layout, "cuda:0", shared=False)
        sink = InProcessSink(local, {i: pool.tensor for i, pool in enumerate(pools)})
        sink._reads[local.device] = not staged  # NOTE: as for a remote GPU without peer access
        sink.open(0, desc, pools[0].layout.fingerprint())
        assert sink.attached == ATTACHED[(p, d)][r]
        sink.pull(0, SRC, DST).wait()
        pulled = local.tensor.cpu()
        assert same_bits(pulled[:, :, DST], expected_heads(full, layout))
        assert not pulled[:, :, [b for b in range(SINK_BLOCKS) if b not in DST]].any()
        assert (not sink._plans) if staged else (len(sink._plans) == len(sink._remotes[0].segments))
        sink.close_all()
        assert not sink._plans


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2)])
def test_decode_rank_maps_a_prefill_group_across_processes(p: int, d: int) -> None:
    """A spawned decode rank maps the IPC handles of the prefill ranks holding its heads and pulls them."""
    full = full_pool("bfloat16")
    pools = prefill_group(full, p, "bfloat16")
    desc = group_descriptor(pools)
    for r in range(d):
        layout = replace(TP_LAYOUT, dtype="bfloat16", num_blocks=SINK_BLOCKS, tp_size=d, tp_rank=r)
        pulled = torch.from_numpy(run_sink(desc, "cuda:0", d, r))  # float32 copies of the bf16 pool
        assert torch.equal(pulled[:, :, DST], expected_heads(full, layout).float())
        assert not pulled[:, :, [b for b in range(SINK_BLOCKS) if b not in DST]].any()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_decode_rank_on_another_gpu_pulls_a_prefill_groups_heads() -> None:
    """Prefill TP 2 on cuda:0, a decode worker of TP 1 on cuda:1 in another process: both pools mapped on the
    decode GPU (peer access) or staged, its heads bit-exact."""
    full = full_pool("bfloat16")
    desc = group_descriptor(prefill_group(full, 2, "bfloat16"))
    layout = replace(TP_LAYOUT, dtype="bfloat16", num_blocks=SINK_BLOCKS)
    pulled = torch.from_numpy(run_sink(desc, "cuda:1"))
    assert torch.equal(pulled[:, :, DST], expected_heads(full, layout).float())
    assert not pulled[:, :, [b for b in range(SINK_BLOCKS) if b not in DST]].any()
