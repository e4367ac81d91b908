"""The block gather-copy kernel against its torch reference: small pools on CPU under the Triton interpreter (in a
subprocess, since the interpreter flag must be set before triton is imported), and the real kernel on CUDA over
dtypes, odd chunk sizes, head slices between pools of different KV heads (TP ranks), large pools, a CUDA graph
and the cuda_ipc transport.

Pools are filled with random bytes (NaN patterns included) and compared bit for bit: the copied blocks equal the
source's, every other destination block keeps its old bytes.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")

from pdserve.kernels import block_copy
from pdserve.kernels.block_copy import BlockCopy, Runs, copy_blocks, copy_blocks_ref, tile_words, word_dtype
from pdserve.kvtransfer.base import Segment
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.pool import allocate_kv_pool

REPO_ROOT = Path(__file__).resolve().parents[2]


class Case(NamedTuple):
    dtype: torch.dtype
    num_layers: int
    block_shape: tuple[int, int, int]  # block_size, num_kv_heads, head_dim
    src_num_blocks: int
    dst_num_blocks: int
    n: int
    tile_bytes: int = block_copy.DEFAULT_TILE_BYTES
    ids_dtype: torch.dtype = torch.int64
    dst_kv_heads: int | None = None  # None: block_shape's, as the source
    src_heads: tuple[int, int] | None = None  # (first, count) copied; None: every head
    dst_heads: tuple[int, int] | None = None


CPU_CASES = [
    Case(torch.float32, 2, (4, 2, 8), 11, 7, 5),  # 256-byte chunk: int64 words, one tile
    Case(torch.float32, 2, (4, 2, 8), 11, 7, 1, ids_dtype=torch.int32),
    Case(torch.float32, 2, (4, 2, 8), 6, 9, 6),  # every source block
    Case(torch.bfloat16, 3, (4, 3, 8), 5, 13, 4, tile_bytes=64),  # 24 words in 3 even tiles
    Case(torch.float16, 2, (1, 1, 63), 9, 8, 8, ids_dtype=torch.int32),  # 63 int16 words, one masked tile
    Case(torch.float16, 1, (1, 1, 63), 9, 8, 3, tile_bytes=32),  # 4 tiles, the last masked
    Case(torch.float32, 2, (1, 1, 3), 4, 4, 4),  # 12 bytes: int32 words
    Case(torch.bfloat16, 2, (2, 2, 4), 12, 20, 0),
    # head slices: one run per token row
    Case(torch.float32, 2, (4, 4, 8), 11, 7, 5, dst_kv_heads=2, src_heads=(2, 2), dst_heads=(0, 2)),  # TP 1 -> 2
    Case(torch.float32, 2, (4, 2, 8), 11, 7, 5, dst_kv_heads=4, src_heads=(0, 2), dst_heads=(2, 2)),  # TP 2 -> 1
    Case(torch.bfloat16, 2, (3, 4, 8), 9, 9, 4, dst_kv_heads=1, src_heads=(3, 1), dst_heads=(0, 1)),  # 16-byte runs
    Case(torch.float16, 2, (2, 3, 6), 8, 6, 3, dst_kv_heads=5, src_heads=(1, 2), dst_heads=(2, 2)),  # int32 words
    Case(torch.float16, 1, (2, 3, 5), 6, 6, 4, dst_kv_heads=3, src_heads=(1, 1), dst_heads=(2, 1)),  # int16 words
    Case(torch.float16, 1, (2, 4, 32), 6, 5, 3, 64, dst_kv_heads=4, src_heads=(1, 3), dst_heads=(0, 3)),  # masked
    Case(torch.float32, 2, (4, 4, 8), 11, 7, 5, dst_kv_heads=4, src_heads=(1, 2), dst_heads=(1, 2)),  # same pools
    Case(torch.float16, 1, (2, 3, 5), 6, 6, 4, 8, dst_kv_heads=3, src_heads=(1, 1), dst_heads=(2, 1)),  # 2 tiles a run
    Case(torch.float32, 1, (16, 2, 8), 5, 5, 3, 64, dst_kv_heads=1, src_heads=(1, 1), dst_heads=(0, 1)),  # 8 row groups
    Case(torch.float32, 1, (3, 2, 8), 5, 5, 3, 64, dst_kv_heads=1, src_heads=(1, 1), dst_heads=(0, 1)),  # masked rows
]
"""Small cases for the interpreter: fp32/bf16/fp16, int64/int32/int16 words, even and masked tiles, n 0, 1, many,
different source and destination num_blocks, int32 and int64 ids, head slices between pools of different heads."""


def random_pool(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    """A pool of random bytes (NaN and inf patterns included), drawn on device."""
    gen = torch.Generator(device).manual_seed(seed)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen, device=device).view(dtype).view(shape)


def scattered_ids(n: int, num_src: int, num_dst: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n distinct source and n distinct destination block ids, in random order (CPU int64)."""
    return torch.randperm(num_src, generator=gen)[:n], torch.randperm(num_dst, generator=gen)[:n]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    src_heads: tuple[int, int] | None = None,
    dst_heads: tuple[int, int] | None = None,
    **kwargs: int,
) -> None:
    """copy_blocks changes dst exactly as copy_blocks_ref does: the given blocks (and heads), bit for bit, and
    nothing else."""
    expected = dst.clone()
    copy_blocks_ref(src, expected, src_ids, dst_ids, src_heads, dst_heads)
    copy_blocks(src, dst, src_ids, dst_ids, src_heads=src_heads, dst_heads=dst_heads, **kwargs)
    assert same_bytes(dst, expected)


def run_case(case: Case, seed: int, device: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    block_size, src_kv_heads, head_dim = case.block_shape
    dst_block = (block_size, case.dst_kv_heads or src_kv_heads, head_dim)
    src = random_pool((case.num_layers, 2, case.src_num_blocks, *case.block_shape), case.dtype, seed, device)
    dst = random_pool((case.num_layers, 2, case.dst_num_blocks, *dst_block), case.dtype, seed + 1, device)
    src_ids, dst_ids = scattered_ids(case.n, case.src_num_blocks, case.dst_num_blocks, gen)
    src_ids, dst_ids = src_ids.to(device, case.ids_dtype), dst_ids.to(device, case.ids_dtype)
    check_copy(src, dst, src_ids, dst_ids, case.src_heads, case.dst_heads, tile_bytes=case.tile_bytes)


def check_cpu_cases() -> None:
    """Entry point of the interpreter subprocess; an AssertionError makes it exit non-zero."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for i, case in enumerate(CPU_CASES):
        run_case(case, seed=i, device="cpu")


@pytest.mark.slow
def test_kernel_matches_reference_under_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.kernels.test_block_copy import check_cpu_cases; check_cpu_cases()"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_word_is_the_widest_dividing_the_chunk_and_addresses() -> None:
    pool = torch.zeros(64, dtype=torch.float16)
    assert word_dtype(256, pool) == torch.int64
    assert word_dtype(12, pool) == torch.int32
    assert word_dtype(126, pool) == torch.int16
    assert word_dtype(256, pool[1:]) == torch.int16  # an address 2 bytes past an aligned one
    assert word_dtype(7, torch.zeros(8, dtype=torch.uint8)) == torch.uint8


def test_tile_divides_the_chunk_unless_that_makes_it_small() -> None:
    assert tile_words(4096, 2048) == 2048  # Llama-8B bf16 chunk, 16 KB tiles
    assert tile_words(3072, 2048) == 1024  # 24 KB chunk: 3 even 8 KB tiles
    assert tile_words(2560, 2048) == 2048  # 20 KB chunk: 4 KB would divide; two 16 KB tiles, the last masked
    assert tile_words(24, 8) == 8
    assert tile_words(63, 8192) == 64  # one masked tile
    assert tile_words(32, 8192) == 32


def test_whole_blocks_are_one_run_and_head_slices_one_run_per_token_row() -> None:
    src, dst = torch.zeros(2, 2, 3, 4, 4, 8), torch.zeros(2, 2, 5, 4, 2, 8)  # fp32: 32-byte heads
    assert BlockCopy(src, src).runs == Runs(rows=1, run=64, src_block=64, dst_block=64, src_row=0, dst_row=0,
                                            src_off=0, dst_off=0)  # fmt: skip
    plan = BlockCopy(src, dst, src_heads=(2, 2), dst_heads=(0, 2))  # int64 words
    assert plan.runs == Runs(rows=4, run=8, src_block=64, dst_block=32, src_row=16, dst_row=8, src_off=8, dst_off=0)
    assert plan.src_words.dtype == torch.int64 and plan.tile == 8 and plan.tiles_per_run == 1
    assert plan.row_tile == 4  # one program per block: the 4 rows of 64 bytes fit a tile
    assert BlockCopy(src, dst, src_heads=(2, 2), dst_heads=(0, 2), tile_bytes=128).row_tile == 2
    assert BlockCopy(src, dst, src_heads=(2, 2), dst_heads=(0, 2), tile_bytes=32).tiles_per_run == 2
    assert BlockCopy(src, dst, src_heads=(2, 2), dst_heads=(0, 2), tile_bytes=32).row_tile == 1
    assert BlockCopy(src, src).row_tile == 1  # whole blocks: one run per block, tiled along it
    odd = BlockCopy(torch.zeros(1, 2, 3, 4, 3, 3), torch.zeros(1, 2, 3, 4, 1, 3), src_heads=(1, 1))  # 12-byte heads
    assert odd.src_words.dtype == torch.int32 and odd.runs.src_off == 3 and odd.runs.run == 3
    half = torch.zeros(1, 2, 3, 2, 3, 5, dtype=torch.float16)  # 10-byte heads: int16 words
    assert BlockCopy(half, half, src_heads=(0, 2), dst_heads=(1, 2)).src_words.dtype == torch.int16


@pytest.mark.parametrize(
    ("heads", "message"),
    [
        ({"src_heads": (0, 2)}, "2 source heads, 4 destination heads"),
        ({"src_heads": (3, 2), "dst_heads": (0, 2)}, r"source heads 3..4 outside the pool's 4"),
        ({"dst_heads": (0, 4), "src_heads": (0, 4)}, r"destination heads 0..3 outside the pool's 2"),
        ({"src_heads": (0, 0), "dst_heads": (0, 0)}, "source heads 0..-1"),
    ],
)
def test_rejects_head_runs_outside_the_pools_or_of_other_lengths(heads: dict, message: str) -> None:
    src, dst = torch.zeros(2, 2, 3, 4, 4, 8), torch.zeros(2, 2, 5, 4, 2, 8)
    with pytest.raises(AssertionError, match=message):
        BlockCopy(src, src if "dst_heads" not in heads else dst, **heads)


def test_reference_copies_head_slices() -> None:
    src, dst = torch.randn(2, 2, 3, 4, 4, 8), torch.zeros(2, 2, 5, 4, 2, 8)
    copy_blocks_ref(src, dst, torch.tensor([2, 0]), torch.tensor([1, 4]), (1, 2), (0, 2))
    assert torch.equal(dst[:, :, [1, 4]], src[:, :, [2, 0], :, 1:3])
    assert not dst[:, :, [0, 2, 3]].any()


def test_no_blocks_launches_nothing() -> None:
    src, dst = torch.ones(2, 2, 3, 4, 1, 8), torch.zeros(2, 2, 5, 4, 1, 8)
    empty = torch.zeros(0, dtype=torch.int64)
    copy_blocks(src, dst, empty, empty)  # on CPU, without the interpreter: a launch would fail
    assert not dst.any()


@pytest.mark.parametrize(
    ("dst", "message"),
    [
        (torch.zeros(2, 2, 5, 4, 1, 4), "pools differ beyond num_blocks and kv_heads"),
        (torch.zeros(2, 2, 5, 2, 1, 8), "pools differ beyond num_blocks and kv_heads"),
        (torch.zeros(2, 2, 5, 4, 2, 8), "1 source heads, 2 destination heads"),
        (torch.zeros(2, 2, 5, 4, 1, 8, dtype=torch.float16), "dtype mismatch"),
        (torch.zeros(2, 2, 5, 8, 1, 4).transpose(3, 5), "contiguous"),
    ],
)
def test_rejects_pools_that_do_not_match(dst: torch.Tensor, message: str) -> None:
    src, ids = torch.ones(2, 2, 3, 4, 1, 8), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(AssertionError, match=message):
        copy_blocks(src, dst, ids, ids)


def test_rejects_ids_of_other_lengths_or_dtypes() -> None:
    src, dst = torch.ones(2, 2, 3, 4, 1, 8), torch.zeros(2, 2, 5, 4, 1, 8)
    with pytest.raises(AssertionError, match="2 source ids, 1 destination ids"):
        copy_blocks(src, dst, torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(AssertionError, match="int32 or int64"):
        copy_blocks(src, dst, torch.zeros(1), torch.zeros(1))


# --- CUDA ---------------------------------------------------------------------------------------------

LLAMA_8B_BLOCK = (16, 8, 128)
"""block_size, num_kv_heads, head_dim of Llama-3-8B: a 32 KB chunk in bf16."""


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [1, 37, 200])
def test_matches_reference_on_gpu(dtype: torch.dtype, ids_dtype: torch.dtype, n: int) -> None:
    run_case(Case(dtype, 4, LLAMA_8B_BLOCK, 300, 200, n, ids_dtype=ids_dtype), seed=n, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "block_shape"),
    [
        (torch.bfloat16, (16, 8, 96)),  # 24 KB: three 8 KB tiles
        (torch.float16, (16, 5, 128)),  # 20 KB: a masked second tile
        (torch.float16, (1, 1, 63)),  # int16 words, masked
        (torch.float32, (2, 1, 3)),  # int32 words
        (torch.bfloat16, (32, 32, 128)),  # 256 KB: 16 tiles
    ],
)
def test_odd_chunk_sizes_match_reference_on_gpu(dtype: torch.dtype, block_shape: tuple[int, int, int]) -> None:
    run_case(Case(dtype, 3, block_shape, 70, 90, 41), seed=1, device="cuda")


HEAD_SLICES = [
    (8, 4, (0, 4), (0, 4)),  # TP 1 -> 2: rank 0
    (8, 4, (4, 4), (0, 4)),  # TP 1 -> 2: rank 1
    (4, 8, (0, 4), (4, 4)),  # TP 2 -> 1: rank 1's heads
    (8, 1, (5, 1), (0, 1)),  # TP 1 -> 8
    (1, 8, (0, 1), (7, 1)),  # TP 8 -> 1
    (2, 4, (1, 1), (3, 1)),  # TP 4 -> 2
    (8, 8, (2, 3), (5, 3)),  # equal pools, a run of three heads
]
"""(source kv_heads, destination kv_heads, source (first, count), destination (first, count)) of a copy."""


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", HEAD_SLICES)
def test_head_slices_match_reference_on_gpu(
    dtype: torch.dtype, block_size: int, heads: tuple[int, int, tuple[int, int], tuple[int, int]]
) -> None:
    src_kv_heads, dst_kv_heads, src_heads, dst_heads = heads
    case = Case(dtype, 4, (block_size, src_kv_heads, 128), 300, 200, 37, ids_dtype=torch.int32,
                dst_kv_heads=dst_kv_heads, src_heads=src_heads, dst_heads=dst_heads)  # fmt: skip
    run_case(case, seed=block_size, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "block_shape", "tile_bytes"),
    [
        (torch.float16, (16, 4, 63), block_copy.DEFAULT_TILE_BYTES),  # 126-byte heads: int16 words, masked tiles
        (torch.bfloat16, (16, 4, 80), block_copy.DEFAULT_TILE_BYTES),  # 160-byte heads: int64 words, masked
        (torch.float32, (16, 4, 3), block_copy.DEFAULT_TILE_BYTES),  # 12-byte heads: int32 words
        (torch.bfloat16, (16, 4, 128), 256),  # a 512-byte run in two tiles
        (torch.bfloat16, (16, 4, 96), 128),  # a 384-byte run in three tiles
    ],
)
def test_head_slices_of_odd_widths_and_tiles_match_reference_on_gpu(
    dtype: torch.dtype, block_shape: tuple[int, int, int], tile_bytes: int
) -> None:
    for src_heads, dst_heads in (((1, 2), (0, 2)), ((2, 2), (1, 2)), ((3, 1), (2, 1))):
        case = Case(dtype, 3, block_shape, 70, 90, 41, tile_bytes, dst_kv_heads=3, src_heads=src_heads,
                    dst_heads=dst_heads)  # fmt: skip
        run_case(case, seed=src_heads[0], device="cuda")


@pytest.mark.gpu
def test_head_slice_copy_replays_in_a_cuda_graph_on_gpu() -> None:
    gen = torch.Generator().manual_seed(8)
    src = random_pool((4, 2, 50, 16, 8, 128), torch.bfloat16, 8, "cuda")
    dst = random_pool((4, 2, 60, 16, 2, 128), torch.bfloat16, 9, "cuda")
    plan = BlockCopy(src, dst, src_heads=(6, 2), dst_heads=(0, 2))
    src_ids, dst_ids = (ids.cuda() for ids in scattered_ids(9, 50, 60, gen))
    plan(src_ids, dst_ids)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan(src_ids, dst_ids)
    new_src, new_dst = scattered_ids(9, 50, 60, gen)
    src_ids.copy_(new_src)
    dst_ids.copy_(new_dst)
    expected = dst.clone()
    copy_blocks_ref(src, expected, new_src.cuda(), new_dst.cuda(), (6, 2), (0, 2))
    graph.replay()
    torch.cuda.synchronize()
    assert same_bytes(dst, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_bytes", [256, 4096, 8192, 32768, 65536])
def test_every_tile_size_matches_reference_on_gpu(tile_bytes: int) -> None:
    run_case(Case(torch.bfloat16, 4, LLAMA_8B_BLOCK, 64, 48, 30, tile_bytes=tile_bytes), seed=2, device="cuda")


@pytest.mark.gpu
def test_misaligned_pools_fall_back_to_narrower_words_on_gpu() -> None:
    gen = torch.Generator().manual_seed(3)
    shape = (2, 2, 40, 16, 2, 64)
    src_buf = random_pool((math.prod(shape) + 1,), torch.bfloat16, 3, "cuda")
    dst_buf = random_pool((math.prod(shape) + 3,), torch.bfloat16, 4, "cuda")
    src, dst = src_buf[1:].view(shape), dst_buf[3:].view(shape)  # 2 and 6 bytes past 16-byte alignment
    src_ids, dst_ids = scattered_ids(17, 40, 40, gen)
    check_copy(src, dst, src_ids.cuda(), dst_ids.cuda())


@pytest.mark.gpu
def test_llama_8b_layout_with_gigabyte_pools_matches_reference_on_gpu() -> None:
    """32 layers, 2 GB source and 1.5 GB destination pools, 400 blocks (800 MB) in one launch."""
    run_case(Case(torch.bfloat16, 32, LLAMA_8B_BLOCK, 1000, 750, 400), seed=4, device="cuda")


@pytest.mark.gpu
def test_pool_past_2_31_words_on_gpu() -> None:
    """int16 words (126-byte chunks) in a 4.3 GB destination: its top blocks lie past word 2^31 (byte 2^32)."""
    block_shape = (1, 1, 63)
    dst_num_blocks = 2**31 // 63 // 2 + 4096
    if torch.cuda.mem_get_info()[0] < 4 * 2 * dst_num_blocks * 63 * 2:  # dst, its clone, comparison temporaries
        pytest.skip("needs ~18 GB of free GPU memory")
    gen = torch.Generator().manual_seed(5)
    src = random_pool((1, 2, 64, *block_shape), torch.float16, 5, "cuda")
    dst = torch.full((1, 2, dst_num_blocks, *block_shape), -1.0, dtype=torch.float16, device="cuda")
    dst_ids = torch.cat([torch.arange(dst_num_blocks - 32, dst_num_blocks), torch.arange(32)])  # top and bottom
    check_copy(src, dst, torch.randperm(64, generator=gen).cuda(), dst_ids.cuda())


@pytest.mark.gpu
def test_cuda_graph_replay_copies_the_ids_the_buffers_hold_on_gpu() -> None:
    gen = torch.Generator().manual_seed(6)
    src = random_pool((4, 2, 50, *LLAMA_8B_BLOCK), torch.bfloat16, 6, "cuda")
    dst = random_pool((4, 2, 60, *LLAMA_8B_BLOCK), torch.bfloat16, 7, "cuda")
    src_ids, dst_ids = (ids.cuda() for ids in scattered_ids(9, 50, 60, gen))
    copy_blocks(src, dst, src_ids, dst_ids)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_blocks(src, dst, src_ids, dst_ids)
    new_src, new_dst = scattered_ids(9, 50, 60, gen)
    src_ids.copy_(new_src)
    dst_ids.copy_(new_dst)
    expected = dst.clone()
    copy_blocks_ref(src, expected, new_src.cuda(), new_dst.cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert same_bytes(dst, expected)


# --- the cuda_ipc transport ---------------------------------------------------------------------------

LAYOUT = KVLayout(
    model="tiny", dtype="bfloat16", block_size=16, num_layers=4, num_kv_heads=8, head_dim=128, num_blocks=96
)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cuda_ipc_sink_copies_through_the_kernel_on_one_gpu(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaIpcSink._copy with the remote pool on the local pool's GPU: one copy_blocks launch, exact blocks once
    the handle is done."""
    check_sink_kernel_copy(dtype, "cuda:0", monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_ipc_sink_reads_a_peer_gpu_through_the_kernel(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The remote pool on another GPU with peer access: still one launch, on the sink's GPU, exact blocks."""
    check_sink_kernel_copy(dtype, "cuda:1", monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kernel_reads_a_pool_on_a_peer_gpu() -> None:
    from pdserve.kvtransfer.cuda_ipc import enable_peer_access

    assert enable_peer_access(torch.device("cuda:0"), torch.device("cuda:1")), "the two GPUs have no peer access"
    gen = torch.Generator().manual_seed(5)
    src = random_pool((3, 2, 200, *LLAMA_8B_BLOCK), torch.bfloat16, 5, "cuda:1")
    dst = random_pool((3, 2, 150, *LLAMA_8B_BLOCK), torch.bfloat16, 6, "cuda:0")
    src_ids, dst_ids = scattered_ids(61, 200, 150, gen)
    expected = dst.clone()
    expected[:, :, dst_ids.cuda(0)] = src[:, :, src_ids.cuda(1)].to("cuda:0")
    copy_blocks(src, dst, src_ids.cuda(0), dst_ids.cuda(0))
    assert same_bytes(dst, expected)


def check_sink_kernel_copy(dtype: str, remote_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.kvtransfer.cuda_ipc import CudaIpcSink

    launches = []
    launch = block_copy.BlockCopy.__call__

    def counting_launch(plan: block_copy.BlockCopy, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        launches.append(src_ids.numel())
        launch(plan, src_ids, dst_ids)

    monkeypatch.setattr(block_copy.BlockCopy, "__call__", counting_launch)
    layout = replace(LAYOUT, dtype=dtype)
    remote = random_pool(layout.shape, layout.torch_dtype, 7, remote_device)
    local = allocate_kv_pool(replace(layout, num_blocks=40), "cuda:0", shared=False)
    before = local.tensor.clone()
    sink = CudaIpcSink(local, local.layout)
    src, dst = [95, 3, 17, 8, 0, 22, 41], [1, 39, 5, 6, 12, 2, 30]
    whole = (Segment(0, 0, 0, layout.heads[1]),)
    sink._copy({0: remote}, whole, src, dst).wait()
    assert launches == [len(src)]
    copy_blocks_ref(remote.to(local.device), before, torch.tensor(src).cuda(), torch.tensor(dst).cuda())
    assert same_bytes(local.tensor, before)
    local.tensor.zero_()
    sink._copy({0: remote}, whole, src[:3], dst[:3]).wait()  # the same pools again: the plan made by the first pull
    assert launches == [len(src), 3] and len(sink._plans) == 1
    assert same_bytes(local.tensor[:, :, dst[:3]], remote[:, :, src[:3]].to(local.device))
    assert sink._plans[(remote.data_ptr(), whole[0])].runs.rows == 1  # whole blocks: the one-run-per-block path


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_ipc_sink_copies_head_segments_in_one_launch_each(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two remote ranks (TP 2, 4 heads each) into one local pool of 8 heads: a launch per segment, one handle,
    exact heads; then one remote pool's heads 2..5 into the middle of ours."""
    from pdserve.kvtransfer.cuda_ipc import CudaIpcSink

    launches = []
    launch = block_copy.BlockCopy.__call__

    def counting_launch(plan: block_copy.BlockCopy, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        launches.append(src_ids.numel())
        launch(plan, src_ids, dst_ids)

    monkeypatch.setattr(block_copy.BlockCopy, "__call__", counting_launch)
    layout = replace(LAYOUT, dtype=dtype)
    remotes = {r: random_pool(replace(layout, tp_size=2, tp_rank=r).shape, layout.torch_dtype, 7 + r, "cuda:0")
               for r in range(2)}  # fmt: skip
    local = allocate_kv_pool(replace(layout, num_blocks=40), "cuda:0", shared=False)
    sink = CudaIpcSink(local, local.layout)
    src, dst = [95, 3, 17, 8, 0, 22, 41], [1, 39, 5, 6, 12, 2, 30]
    segments = (Segment(0, 0, 0, 4), Segment(1, 0, 4, 4))
    sink._copy(remotes, segments, src, dst).wait()
    assert launches == [len(src), len(src)] and len(sink._plans) == 2
    assert same_bytes(local.tensor[:, :, dst], torch.cat([remotes[0][:, :, src], remotes[1][:, :, src]], dim=4))
    untouched = [b for b in range(40) if b not in dst]
    assert not local.tensor[:, :, untouched].any()
    local.tensor.zero_()
    sink._copy({1: remotes[1]}, (Segment(1, 1, 2, 3),), src[:2], dst[:2]).wait()
    expected = torch.zeros_like(local.tensor)
    expected[:, :, dst[:2], :, 2:5] = remotes[1][:, :, src[:2], :, 1:4]
    assert same_bytes(local.tensor, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_ipc_pull_across_processes_on_one_gpu(dtype: str) -> None:
    """A sink in a spawned process maps the pool by IPC handle and pulls through the kernel."""
    from tests.gpu.test_kvtransfer_cuda import check_pull

    check_pull(dtype, "cuda:0", "cuda:0")
