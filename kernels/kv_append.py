"""KV append in Triton: writes the new tokens' K and V into the paged cache.

Layouts follow kernels/attention.py: kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim]; a token's
K (or V) for every KV head is one row of num_kv_heads * head_dim elements at its slot. One program moves one
token's K and V rows. Three ways to find the slot, one kernel:

- slots: slot_mapping[t], the general path (prefill chunks and mixed batches);
- per-request positions: token t is the one new token of sequence t (an identity batch) at positions[t], so
  slot = block_tables[t, pos // block_size] * block_size + pos % block_size;
- one shared position: every sequence of an identity batch is at positions[0] (a static batch decoding in
  lockstep).

With rope tables, each K row is rotated (kernels/rope_tiles.py) on its way into the cache and also written to
a contiguous [num_tokens, num_kv_heads, head_dim] tensor, for the prefill kernel's new-key reads; given q, the
same program rotates the token's q heads too (one rope launch fewer per layer, and K read once).

NOTE: the decode paths read positions and block tables on the device, so a decode step builds no slot tensor
and a CUDA graph can capture the launch (it reads no device value on the host and allocates nothing).
Padding rows of a captured batch point at position 0 of the null block 0, which is never read unmasked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.rope_tiles import RopeTables, check_tables, load_rotated, rope_ref_one
from pdserve.kernels.triton_utils import pdl_wait


@triton.jit
def _rotate_q(
    q_row,  # token t's q: [num_heads, head_dim], heads stride_qh apart
    out_row,  # token t's row of the contiguous output
    stride_qh,
    pos,
    cos_ptr,
    sin_ptr,
    stride_cos,
    max_positions,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    h_mask = heads < NUM_HEADS
    pos_rows = tl.full([HEADS_PAD], 0, tl.int64) + pos
    q = load_rotated(
        q_row + heads * stride_qh, h_mask, pos_rows, cos_ptr, sin_ptr, stride_cos, max_positions, HEAD_DIM, D_PAD
    )
    offs_d = tl.arange(0, D_PAD)[None, :]
    tl.store(out_row + heads[:, None] * HEAD_DIM + offs_d, q, mask=h_mask[:, None] & (offs_d < HEAD_DIM))


@triton.jit
def _append_kv(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    index_ptr,  # [num_tokens] int64 slots, or [num_tokens | 1] positions
    block_tables_ptr,  # [num_tokens, max_blocks] int32 (positions modes only)
    positions_ptr,  # ROPE: [num_tokens] positions (slots mode; the positions modes read index_ptr)
    cos_ptr,  # ROPE: [max_positions, head_dim]
    sin_ptr,
    k_out_ptr,  # ROPE: [num_tokens, num_kv_heads, head_dim] contiguous, the rotated K
    q_ptr,  # ROPE_Q: [num_tokens, num_heads, head_dim]
    q_out_ptr,  # ROPE_Q: [num_tokens, num_heads, head_dim] contiguous, the rotated q
    max_positions,
    stride_cos,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_h,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MODE: tl.constexpr,  # 0 slots, 1 per-request positions, 2 one shared position
    ROPE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    ROPE_Q: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    t = tl.program_id(0)
    if MODE == 0:
        slot = tl.load(index_ptr + t).to(tl.int64)
        if ROPE:
            pos = tl.load(positions_ptr + t).to(tl.int64)
    else:
        pos = tl.load(index_ptr + (t if MODE == 1 else 0)).to(tl.int64)
        block = tl.load(block_tables_ptr + t.to(tl.int64) * stride_bt + pos // BLOCK_SIZE).to(tl.int64)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
    offs = tl.arange(0, ROW_PAD)
    mask = offs < NUM_KV_HEADS * HEAD_DIM
    head, dim = offs // HEAD_DIM, offs % HEAD_DIM
    dst = cache_ptr + slot * stride_cache_slot + head * stride_cache_h + dim
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + dim, mask=mask)
    tl.store(dst + stride_cache_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)
    if ROPE:
        heads = tl.arange(0, HEADS_PAD)
        h_mask = heads < NUM_KV_HEADS
        pos_rows = tl.full([HEADS_PAD], 0, tl.int64) + pos
        k = load_rotated(
            k_ptr + t * stride_kt + heads * stride_kh, h_mask, pos_rows, cos_ptr, sin_ptr, stride_cos,
            max_positions, HEAD_DIM, D_PAD,
        )  # fmt: skip  # [HEADS_PAD, D_PAD]
        offs_d = tl.arange(0, D_PAD)[None, :]
        k_mask = h_mask[:, None] & (offs_d < HEAD_DIM)
        k_dst = cache_ptr + slot * stride_cache_slot + heads[:, None] * stride_cache_h + offs_d
        tl.store(k_dst, k.to(cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(k_out_ptr + (t.to(tl.int64) * NUM_KV_HEADS + heads[:, None]) * HEAD_DIM + offs_d, k, mask=k_mask)
        if ROPE_Q:
            _rotate_q(
                q_ptr + t * stride_qt, q_out_ptr + t.to(tl.int64) * NUM_HEADS * HEAD_DIM, stride_qh, pos,
                cos_ptr, sin_ptr, stride_cos, max_positions, NUM_HEADS, HEAD_DIM, Q_HEADS_PAD, D_PAD,
            )  # fmt: skip
    else:
        k = tl.load(k_ptr + t * stride_kt + head * stride_kh + dim, mask=mask)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)


def _slots(
    num_tokens: int,
    slot_mapping: torch.Tensor | None,
    positions: torch.Tensor | None,
    block_tables: torch.Tensor | None,
    rope: bool,
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """How _append_kv finds each token's slot: (MODE, its index tensor, its tables tensor); 0: slot_mapping, 1:
    positions (one a token) into block_tables, 2: one shared position."""
    if slot_mapping is not None:
        assert not rope or (positions is not None and positions.shape == (num_tokens,)), "rope needs positions"
        return 0, slot_mapping, slot_mapping
    assert positions is not None and block_tables is not None, "give slot_mapping, or positions and block_tables"
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] >= num_tokens
    assert positions.numel() in (1, num_tokens), "positions: one per token, or one shared"
    return (1 if positions.numel() == num_tokens else 2), positions, block_tables


def append_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor | None = None,  # [num_tokens] int64
    positions: torch.Tensor | None = None,  # [num_tokens] or [1] int64/int32
    block_tables: torch.Tensor | None = None,  # [num_tokens, max_blocks] int32
    rope: RopeTables | None = None,
    q: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], rotated beside k (rope only)
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # (the K written: k, or k rotated), q rotated
    """kv_cache[:, slot(t)] = k[t], v[t]: by slot_mapping, or (decode) by positions and block_tables.

    With rope, k is rotated at its positions (needed then with slot_mapping too) on its way into the cache, and
    so is q when given: new contiguous tensors. With pdl (triton_utils.use_pdl), a programmatic dependent launch.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    _, _, block_size, cache_heads, cache_dim = kv_cache.shape
    assert v.shape == k.shape and (cache_heads, cache_dim) == (num_kv_heads, head_dim), "k/v/cache shapes differ"
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim must be contiguous"
    assert kv_cache.stride(3) == head_dim and kv_cache.stride(2) == num_kv_heads * head_dim, "cache slots not packed"
    mode, index, tables = _slots(num_tokens, slot_mapping, positions, block_tables, rope is not None)
    k_out, q_out = k, None
    if rope is not None:
        check_tables(rope, head_dim, k.dtype)
        k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if q is not None:
        assert rope is not None, "q is only rotated"
        assert q.shape[0] == num_tokens and q.shape[2] == head_dim and q.stride(2) == 1 and q.dtype == k.dtype
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return k_out, q_out
    cos, sin = rope if rope is not None else (k, k)  # unread without rope
    q_in = q if q is not None else k  # unread without q
    _append_kv[(num_tokens,)](
        k, v, kv_cache, index, tables, positions if rope is not None else index, cos, sin, k_out,
        q_in, q_out if q_out is not None else k_out,
        cos.shape[0], cos.stride(0), q_in.stride(0), q_in.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        tables.stride(0) if mode else 0,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        ROW_PAD=triton.next_power_of_2(num_kv_heads * head_dim),
        BLOCK_SIZE=block_size,
        MODE=mode,
        ROPE=rope is not None,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        ROPE_Q=q is not None,
        NUM_HEADS=q_in.shape[1],
        Q_HEADS_PAD=triton.next_power_of_2(q_in.shape[1]),
        PDL=pdl,
        num_warps=4,
        enable_fp_fusion=False,  # NOTE: rope's products and sum round separately, as torch's do
        launch_pdl=pdl,
    )  # fmt: skip
    return k_out, q_out


def append_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    rope: RopeTables | None = None,
    q: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of append_kv."""
    if rope is not None:
        assert positions is not None
        pos = positions.long().expand(k.shape[0])
        k, q = rope_ref_one(pos, k, rope), None if q is None else rope_ref_one(pos, q, rope)
    if slot_mapping is None:
        assert positions is not None and block_tables is not None
        pos = positions.long().expand(k.shape[0])  # [num_tokens]
        bs = kv_cache.shape[2]
        rows = torch.arange(k.shape[0], device=k.device)
        slot_mapping = block_tables.long()[rows, pos // bs] * bs + pos % bs
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
    return k, q
