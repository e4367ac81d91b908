"""Block gather-copy in Triton for the prefill -> decode KV handoff: dst[:, :, dst_ids, :, dst heads] =
src[:, :, src_ids, :, src heads], where each side's heads are one run of KV heads (all of them by default).

Both pools are whole, contiguous KV pools [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]; they may
differ in num_blocks and kv_heads (the TP ranks of a prefill and a decode worker hold different heads). Block b
of one layer and one of K/V is a contiguous chunk of block_size * kv_heads * head_dim elements, chunk number
(layer * 2 + kv) * num_blocks + b of the pool, so a handoff of n blocks moves num_layers * 2 * n chunks,
scattered in both pools. The unit copied is a run: the whole chunk when both sides copy all their heads (rows = 1),
else one token row's slice of it (rows = block_size runs per chunk), count * head_dim elements from head `first`
of a row of kv_heads * head_dim elements.

The kernel copies runs as raw words, the widest of 8/4/2/1 bytes that divides a run, both rows' widths and both
runs' offsets in them (and both pools' addresses): the dtype does not matter, the copy is bit-exact, and with
8-byte words each thread moves 16-byte vectors. A tile is a power of two of words, at most tile_bytes (16 KB by
default): a run longer than one tile takes tiles_per_run programs, while a program whose run fits one tile copies
row_tile runs (rows) of one block, as many as fit tile_bytes, so short head slices still move kilobytes per
program. One launch covers every block of every layer: a 1-D grid of num_layers * 2 * n * row_groups *
tiles_per_run programs (row_groups = cdiv(rows, row_tile)), where program p copies tile p % tiles_per_run of
rows [g * row_tile, (g + 1) * row_tile) of chunk c, g = p // tiles_per_run % row_groups and
c = p // tiles_per_run // row_groups; chunk c = (layer * 2 + kv) * n + i moves block src_ids[i] to dst_ids[i].
Pool offsets are int64: a pool may exceed 2^31 words.

NOTE (streams): the kernel runs on the current stream and reads the ids there. The caller orders it after the
writes into src and before any reader of dst on other streams (wait_stream or events), and keeps src_ids and
dst_ids, and a pinned host buffer they were copied from with non_blocking=True, alive until it has run
(synchronize, or record_stream on a stream of its own).
NOTE (CUDA graphs): the launch reads no device value on the host and allocates nothing, so a graph can capture
it for a fixed n (the grid depends on n) with id buffers that keep their address; replays copy whatever ids
those buffers then hold.
NOTE (two GPUs): the kernel runs on the GPU that holds the ids; either pool may live on another GPU that this
one can reach (peer access enabled, or a CUDA IPC mapping opened on this GPU, as kvtransfer.cuda_ipc does), so a
cross-GPU handoff is one launch that reads or writes over NVLink with no staging copy.
NOTE: nothing is checked on the device: ids must be in range (else it reads or writes out of bounds), dst_ids
must not repeat (else two programs race for one block), and src and dst blocks must not overlap.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

DEFAULT_TILE_BYTES = 16384
"""Bytes one program copies (at most): 128 bytes, eight 16-byte vectors, per thread of 4 warps."""
DEFAULT_NUM_WARPS = 4
WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
"""Word types a run is copied as, widest first."""


@triton.jit(do_not_specialize=["n", "src_num_blocks", "dst_num_blocks"])
def _copy_blocks(
    src_ptr,  # [num_layers * 2 * src_num_blocks * SRC_BLOCK] words
    dst_ptr,  # [num_layers * 2 * dst_num_blocks * DST_BLOCK] words
    src_ids_ptr,  # [n] int32 | int64
    dst_ids_ptr,  # [n] int32 | int64
    n,
    src_num_blocks,
    dst_num_blocks,
    SRC_BLOCK: tl.constexpr,  # words of one block of one layer, K or V, in src
    DST_BLOCK: tl.constexpr,  # the same in dst
    ROWS: tl.constexpr,  # runs per block: 1 (the run is the whole block) or block_size (one per token row)
    SRC_ROW: tl.constexpr,  # words from one run of a src block to the next (0 when ROWS is 1)
    DST_ROW: tl.constexpr,
    SRC_OFF: tl.constexpr,  # words from the start of a src row to its run
    DST_OFF: tl.constexpr,
    RUN: tl.constexpr,  # words of one run
    TILE: tl.constexpr,  # words per program and run, a power of two
    TILES_PER_RUN: tl.constexpr,
    ROW_TILE: tl.constexpr,  # runs per program, a power of two (> 1 only when TILES_PER_RUN is 1)
    ROW_GROUPS: tl.constexpr,  # cdiv(ROWS, ROW_TILE)
    EVEN: tl.constexpr,  # RUN % TILE == 0 and ROWS % ROW_TILE == 0: no mask
):
    pid = tl.program_id(0)
    group = pid // TILES_PER_RUN  # NOTE: whole blocks (ROWS 1): group is the chunk and first_row 0
    tile = pid % TILES_PER_RUN
    chunk = group // ROW_GROUPS
    first_row = group % ROW_GROUPS * ROW_TILE
    plane = (chunk // n).to(tl.int64)  # layer * 2 + kv
    i = chunk % n
    src_block = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + i).to(tl.int64)
    # NOTE: int64 starts; the strides and TILE as constants tell the compiler the starts' alignment (16-byte vectors)
    src_start = (plane * src_num_blocks + src_block) * SRC_BLOCK + first_row * SRC_ROW + SRC_OFF + tile * TILE
    dst_start = (plane * dst_num_blocks + dst_block) * DST_BLOCK + first_row * DST_ROW + DST_OFF + tile * TILE
    if ROW_TILE == 1:
        offs = tl.arange(0, TILE)
        if EVEN:
            words = tl.load(src_ptr + src_start + offs)
            tl.store(dst_ptr + dst_start + offs, words)
        else:
            mask = offs < RUN - tile * TILE
            words = tl.load(src_ptr + src_start + offs, mask=mask)
            tl.store(dst_ptr + dst_start + offs, words, mask=mask)
    else:  # short runs: ROW_TILE rows of one block per program, [ROW_TILE, TILE] words
        rows = tl.arange(0, ROW_TILE)[:, None]
        cols = tl.arange(0, TILE)[None, :]
        if EVEN:
            words = tl.load(src_ptr + src_start + rows * SRC_ROW + cols)
            tl.store(dst_ptr + dst_start + rows * DST_ROW + cols, words)
        else:
            mask = (rows < ROWS - first_row) & (cols < RUN)
            words = tl.load(src_ptr + src_start + rows * SRC_ROW + cols, mask=mask)
            tl.store(dst_ptr + dst_start + rows * DST_ROW + cols, words, mask=mask)


class Runs(NamedTuple):
    """Where a copy's runs lie in each pool's blocks, in bytes (words once divided by the word size)."""

    rows: int
    """Runs per block."""
    run: int
    """Length of one run."""
    src_block: int
    dst_block: int
    src_row: int
    """From one run of a block to the next (0 when rows is 1)."""
    dst_row: int
    src_off: int
    """From the start of a row to its run."""
    dst_off: int


def plan_runs(src: torch.Tensor, dst: torch.Tensor, src_heads: tuple[int, int], dst_heads: tuple[int, int]) -> Runs:
    """The runs of copying heads src_heads (first, count) of src's blocks into dst_heads of dst's: one per block
    when both are every head of their pool, else one per token row."""
    (src_first, count), (dst_first, _) = src_heads, dst_heads
    block_size, head_bytes = src.shape[3], src.shape[5] * src.element_size()
    src_row, dst_row = src.shape[4] * head_bytes, dst.shape[4] * head_bytes  # one token's K (or V), every head
    src_block, dst_block = block_size * src_row, block_size * dst_row
    if count == src.shape[4] == dst.shape[4]:
        return Runs(1, src_block, src_block, dst_block, 0, 0, 0, 0)
    run, src_off, dst_off = count * head_bytes, src_first * head_bytes, dst_first * head_bytes
    return Runs(block_size, run, src_block, dst_block, src_row, dst_row, src_off, dst_off)


def _check_pools(src: torch.Tensor, dst: torch.Tensor) -> None:
    assert src.dim() == 6 and dst.dim() == 6, "pools must be [num_layers, 2, num_blocks, block_size, kv_heads, d]"
    assert all(src.shape[d] == dst.shape[d] for d in (0, 1, 3, 5)), (
        f"pools differ beyond num_blocks and kv_heads: {tuple(src.shape)} vs {tuple(dst.shape)}"
    )
    assert src.dtype == dst.dtype, f"dtype mismatch: src {src.dtype}, dst {dst.dtype}"
    assert src.device.type == dst.device.type, f"device mismatch: src {src.device}, dst {dst.device}"
    assert src.is_contiguous() and dst.is_contiguous(), "pools must be contiguous"


def _head_run(pool: torch.Tensor, heads: tuple[int, int] | None, side: str) -> tuple[int, int]:
    """(first, count) of the pool's KV heads a copy reads or writes: heads, or every head when None."""
    first, count = heads if heads is not None else (0, pool.shape[4])
    assert count >= 1 and first >= 0 and first + count <= pool.shape[4], (
        f"{side} heads {first}..{first + count - 1} outside the pool's {pool.shape[4]}"
    )
    return first, count


def _check_ids(src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    for ids in (src_ids, dst_ids):
        assert ids.dim() == 1 and ids.is_contiguous(), "ids must be contiguous [n]"
        assert ids.dtype in (torch.int32, torch.int64), f"ids must be int32 or int64, not {ids.dtype}"
        assert ids.device == src_ids.device, f"ids on {src_ids.device} and {ids.device}"
    assert src_ids.numel() == dst_ids.numel(), f"{src_ids.numel()} source ids, {dst_ids.numel()} destination ids"


def word_dtype(chunk_bytes: int, *pools: torch.Tensor) -> torch.dtype:
    """The widest word dividing chunk_bytes and every pool's address."""
    for word in WORD_DTYPES:
        if chunk_bytes % word.itemsize == 0 and all(p.data_ptr() % word.itemsize == 0 for p in pools):
            return word
    raise AssertionError("unreachable: bytes always divide")


def tile_words(chunk_words: int, max_tile_words: int) -> int:
    """Words per program: a power of two dividing the chunk (no mask) unless that is under half the largest
    tile the chunk could use, in which case the chunk's last tile is masked."""
    largest = min(max_tile_words, triton.next_power_of_2(chunk_words))
    dividing = min(chunk_words & -chunk_words, largest)  # the largest power of two dividing the chunk, capped
    return dividing if 2 * dividing >= largest else largest


def row_tile(rows: int, tile: int, max_tile_words: int) -> int:
    """Runs per program when one tile holds a whole run: as many rows of a block as fit the largest tile
    (a power of two; the last group of rows is masked when it does not divide rows)."""
    return max(1, min(triton.next_power_of_2(rows), max_tile_words // tile))


class BlockCopy:
    """copy_blocks for one pair of pools and head runs, checked and planned once (runs, word type, tiles, flat
    word views): a call checks the ids and launches. Keeps views of both pools alive (drop it with the pools)."""

    def __init__(
        self,
        src: torch.Tensor,  # [num_layers, 2, src_num_blocks, block_size, src_kv_heads, head_dim], contiguous
        dst: torch.Tensor,  # [num_layers, 2, dst_num_blocks, block_size, dst_kv_heads, head_dim], contiguous
        *,
        src_heads: tuple[int, int] | None = None,  # (first, count) of src's heads read; None: all
        dst_heads: tuple[int, int] | None = None,  # (first, count) of dst's heads written, src's count; None: all
        tile_bytes: int = DEFAULT_TILE_BYTES,
        num_warps: int = DEFAULT_NUM_WARPS,
    ) -> None:
        _check_pools(src, dst)
        src_run, dst_run = _head_run(src, src_heads, "source"), _head_run(dst, dst_heads, "destination")
        assert src_run[1] == dst_run[1], f"{src_run[1]} source heads, {dst_run[1]} destination heads"
        assert tile_bytes >= 1 and tile_bytes & (tile_bytes - 1) == 0, f"tile_bytes not a power of two: {tile_bytes}"
        self.num_planes = src.shape[0] * 2  # layers x (K, V)
        self.src_num_blocks, self.dst_num_blocks = src.shape[2], dst.shape[2]
        runs = plan_runs(src, dst, src_run, dst_run)
        word = word_dtype(math.gcd(*runs[1:]), src, dst)
        self.runs = Runs(runs.rows, *(nbytes // word.itemsize for nbytes in runs[1:]))  # in words
        max_tile_words = max(1, tile_bytes // word.itemsize)
        self.tile = tile_words(self.runs.run, max_tile_words)
        self.tiles_per_run = triton.cdiv(self.runs.run, self.tile)
        self.row_tile = row_tile(self.runs.rows, self.tile, max_tile_words) if self.tiles_per_run == 1 else 1
        tile_bytes = self.row_tile * self.tile * word.itemsize
        self.num_warps = max(1, min(num_warps, tile_bytes // 512))  # >= 16 bytes per thread
        self.src_words, self.dst_words = src.view(-1).view(word), dst.view(-1).view(word)

    def __call__(
        self,
        src_ids: torch.Tensor,  # [n] int32 | int64 on the GPU that runs the copy
        dst_ids: torch.Tensor,  # [n] int32 | int64 on src_ids' device, no repeats
    ) -> None:
        """dst[:, :, dst_ids, :, dst heads] = src[:, :, src_ids, :, src heads] in one launch, bit-exact, on the
        current stream (see NOTEs)."""
        _check_ids(src_ids, dst_ids)
        n = src_ids.numel()
        if n == 0:
            return
        r = self.runs
        row_groups = triton.cdiv(r.rows, self.row_tile)
        num_programs = self.num_planes * n * row_groups * self.tiles_per_run
        assert num_programs < 2**31, f"{num_programs} programs exceed the grid; copy in parts"
        with _on_device(src_ids.device):
            _copy_blocks[(num_programs,)](
                self.src_words, self.dst_words, src_ids, dst_ids, n, self.src_num_blocks, self.dst_num_blocks,
                SRC_BLOCK=r.src_block,
                DST_BLOCK=r.dst_block,
                ROWS=r.rows,
                SRC_ROW=r.src_row,
                DST_ROW=r.dst_row,
                SRC_OFF=r.src_off,
                DST_OFF=r.dst_off,
                RUN=r.run,
                TILE=self.tile,
                TILES_PER_RUN=self.tiles_per_run,
                ROW_TILE=self.row_tile,
                ROW_GROUPS=row_groups,
                EVEN=r.run % self.tile == 0 and r.rows % self.row_tile == 0,
                num_warps=self.num_warps,
            )  # fmt: skip


def copy_blocks(
    src: torch.Tensor,  # [num_layers, 2, src_num_blocks, block_size, src_kv_heads, head_dim], contiguous
    dst: torch.Tensor,  # [num_layers, 2, dst_num_blocks, block_size, dst_kv_heads, head_dim], contiguous, src's dtype
    src_ids: torch.Tensor,  # [n] int32 | int64 on the GPU that runs the copy
    dst_ids: torch.Tensor,  # [n] int32 | int64 on src_ids' device, no repeats
    *,
    src_heads: tuple[int, int] | None = None,
    dst_heads: tuple[int, int] | None = None,
    tile_bytes: int = DEFAULT_TILE_BYTES,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> None:
    """dst[:, :, dst_ids, :, dst heads] = src[:, :, src_ids, :, src heads] in one launch, bit-exact, on the
    current stream (see NOTEs); heads are (first, count), None for all. A caller copying between the same pools
    again and again keeps a BlockCopy instead."""
    plan = BlockCopy(src, dst, src_heads=src_heads, dst_heads=dst_heads, tile_bytes=tile_bytes, num_warps=num_warps)
    plan(src_ids, dst_ids)


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Makes `device` current for the launch (switching only when it is not: the switch costs host time)."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def copy_blocks_ref(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    src_heads: tuple[int, int] | None = None,
    dst_heads: tuple[int, int] | None = None,
) -> None:
    """Torch reference of copy_blocks."""
    src_first, count = src_heads if src_heads is not None else (0, src.shape[4])
    dst_first = dst_heads[0] if dst_heads is not None else 0
    dst[:, :, dst_ids.long(), :, dst_first : dst_first + count] = src[
        :, :, src_ids.long(), :, src_first : src_first + count
    ]
