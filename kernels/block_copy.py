"""Block gather-copy in Triton for the prefill -> decode KV handoff: dst[:, :, dst_ids] = src[:, :, src_ids].

Both pools are whole, contiguous KV pools [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
(num_blocks may differ between them). Block b of one layer and one of K/V is a contiguous chunk of
block_size * num_kv_heads * head_dim elements, chunk number (layer * 2 + kv) * num_blocks + b of the pool, so a
handoff of n blocks moves num_layers * 2 * n chunks, scattered in both pools.

The kernel copies chunks as raw words, the widest of 8/4/2/1 bytes that divides a chunk (and both pools'
addresses): the dtype does not matter, the copy is bit-exact, and with 8-byte words each thread moves 16-byte
vectors. One launch covers every block of every layer: a 1-D grid of num_layers * 2 * n * tiles_per_chunk
programs, where program p copies tile p % tiles_per_chunk of chunk c = p // tiles_per_chunk, and chunk
c = (layer * 2 + kv) * n + i moves block src_ids[i] to dst_ids[i]. A tile is a power of two of words, at most
tile_bytes (16 KB by default). Pool offsets are int64: a pool may exceed 2^31 words.

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

import torch
import triton
import triton.language as tl

DEFAULT_TILE_BYTES = 16384
"""Bytes one program copies (at most): 128 bytes, eight 16-byte vectors, per thread of 4 warps."""
DEFAULT_NUM_WARPS = 4
WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
"""Word types a chunk is copied as, widest first."""


@triton.jit(do_not_specialize=["n", "src_num_blocks", "dst_num_blocks"])
def _copy_blocks(
    src_ptr,  # [num_layers * 2 * src_num_blocks * CHUNK] words
    dst_ptr,  # [num_layers * 2 * dst_num_blocks * CHUNK] words
    src_ids_ptr,  # [n] int32 | int64
    dst_ids_ptr,  # [n] int32 | int64
    n,
    src_num_blocks,
    dst_num_blocks,
    CHUNK: tl.constexpr,  # words of one block of one layer, K or V
    TILE: tl.constexpr,  # words per program, a power of two
    TILES_PER_CHUNK: tl.constexpr,
    EVEN: tl.constexpr,  # CHUNK % TILE == 0: no mask
):
    pid = tl.program_id(0)
    chunk = pid // TILES_PER_CHUNK
    tile = pid % TILES_PER_CHUNK
    plane = (chunk // n).to(tl.int64)  # layer * 2 + kv
    i = chunk % n
    src_block = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + i).to(tl.int64)
    # NOTE: int64 starts; CHUNK and TILE as constants tell the compiler the starts' alignment (16-byte vectors)
    src_start = (plane * src_num_blocks + src_block) * CHUNK + tile * TILE
    dst_start = (plane * dst_num_blocks + dst_block) * CHUNK + tile * TILE
    offs = tl.arange(0, TILE)
    if EVEN:
        words = tl.load(src_ptr + src_start + offs)
        tl.store(dst_ptr + dst_start + offs, words)
    else:
        mask = offs < CHUNK - tile * TILE
        words = tl.load(src_ptr + src_start + offs, mask=mask)
        tl.store(dst_ptr + dst_start + offs, words, mask=mask)


def _check_pools(src: torch.Tensor, dst: torch.Tensor) -> None:
    assert src.dim() == 6 and dst.dim() == 6, "pools must be [num_layers, 2, num_blocks, block_size, kv_heads, d]"
    assert src.shape[:2] == dst.shape[:2] and src.shape[3:] == dst.shape[3:], (
        f"pools differ beyond num_blocks: {tuple(src.shape)} vs {tuple(dst.shape)}"
    )
    assert src.dtype == dst.dtype, f"dtype mismatch: src {src.dtype}, dst {dst.dtype}"
    assert src.device.type == dst.device.type, f"device mismatch: src {src.device}, dst {dst.device}"
    assert src.is_contiguous() and dst.is_contiguous(), "pools must be contiguous"


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


class BlockCopy:
    """copy_blocks for one pair of pools, checked and planned once (word type, tiles, flat word views): a call
    checks the ids and launches. Keeps views of both pools alive (drop it with the pools)."""

    def __init__(
        self,
        src: torch.Tensor,  # [num_layers, 2, src_num_blocks, block_size, kv_heads, head_dim], contiguous
        dst: torch.Tensor,  # [num_layers, 2, dst_num_blocks, block_size, kv_heads, head_dim], contiguous
        *,
        tile_bytes: int = DEFAULT_TILE_BYTES,
        num_warps: int = DEFAULT_NUM_WARPS,
    ) -> None:
        _check_pools(src, dst)
        assert tile_bytes >= 1 and tile_bytes & (tile_bytes - 1) == 0, f"tile_bytes not a power of two: {tile_bytes}"
        self.num_planes = src.shape[0] * 2  # layers x (K, V)
        self.src_num_blocks, self.dst_num_blocks = src.shape[2], dst.shape[2]
        chunk_bytes = math.prod(src.shape[3:]) * src.element_size()
        word = word_dtype(chunk_bytes, src, dst)
        self.chunk_words = chunk_bytes // word.itemsize
        self.tile = tile_words(self.chunk_words, max(1, tile_bytes // word.itemsize))
        self.tiles_per_chunk = triton.cdiv(self.chunk_words, self.tile)
        self.num_warps = max(1, min(num_warps, self.tile * word.itemsize // 512))  # >= 16 bytes per thread
        self.src_words, self.dst_words = src.view(-1).view(word), dst.view(-1).view(word)

    def __call__(
        self,
        src_ids: torch.Tensor,  # [n] int32 | int64 on the GPU that runs the copy
        dst_ids: torch.Tensor,  # [n] int32 | int64 on src_ids' device, no repeats
    ) -> None:
        """dst[:, :, dst_ids] = src[:, :, src_ids] in one launch, bit-exact, on the current stream (see NOTEs)."""
        _check_ids(src_ids, dst_ids)
        n = src_ids.numel()
        if n == 0:
            return
        num_programs = self.num_planes * n * self.tiles_per_chunk
        assert num_programs < 2**31, f"{num_programs} programs exceed the grid; copy in parts"
        with _on_device(src_ids.device):
            _copy_blocks[(num_programs,)](
                self.src_words, self.dst_words, src_ids, dst_ids, n, self.src_num_blocks, self.dst_num_blocks,
                CHUNK=self.chunk_words,
                TILE=self.tile,
                TILES_PER_CHUNK=self.tiles_per_chunk,
                EVEN=self.chunk_words % self.tile == 0,
                num_warps=self.num_warps,
            )  # fmt: skip


def copy_blocks(
    src: torch.Tensor,  # [num_layers, 2, src_num_blocks, block_size, kv_heads, head_dim], contiguous
    dst: torch.Tensor,  # [num_layers, 2, dst_num_blocks, block_size, kv_heads, head_dim], contiguous, src's dtype
    src_ids: torch.Tensor,  # [n] int32 | int64 on the GPU that runs the copy
    dst_ids: torch.Tensor,  # [n] int32 | int64 on src_ids' device, no repeats
    *,
    tile_bytes: int = DEFAULT_TILE_BYTES,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> None:
    """dst[:, :, dst_ids] = src[:, :, src_ids] in one launch, bit-exact, on the current stream (see NOTEs); a
    caller copying between the same pools again and again keeps a BlockCopy instead."""
    BlockCopy(src, dst, tile_bytes=tile_bytes, num_warps=num_warps)(src_ids, dst_ids)


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Makes `device` current for the launch (switching only when it is not: the switch costs host time)."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def copy_blocks_ref(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Torch reference of copy_blocks."""
    dst[:, :, dst_ids.long()] = src[:, :, src_ids.long()]
