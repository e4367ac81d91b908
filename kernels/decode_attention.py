"""Paged decode attention in Triton: one query token per sequence, GQA, optional split-K over the context.

Layouts follow kernels/attention.py: kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K,
1 = V); block_tables rows list a sequence's blocks, padded with the null block 0; seq_lens counts every token
of a sequence, the current one included (its K/V are already in the cache).

Stage 1 runs one program per (sequence, kv head, split). It loads the G = num_heads // num_kv_heads query
heads of its KV head as one [G_PAD, head_dim] tile (G padded to a power of two >= 16 for tl.dot) and walks
its share of the sequence in tiles of TILE_N tokens (choose_decode_config picks TILE_N and warps); each
token's block id is gathered from the block table. Given rope tables, q arrives unrotated and stage 1 rotates
it as it loads it, at the sequence's last position (kernels/rope_tiles.py).
Softmax is online, in fp32, in the log2 domain.
With one split stage 1 writes the output; otherwise it writes a normalised partial output and its
log-sum-exp to a workspace and stage 2 merges the splits.

The launch reads no device value on the host and, given `out` and `workspace`, allocates nothing,
so a CUDA graph can capture it. Each sequence's length is read inside the kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels.rope_tiles import RopeTables, check_tables, load_rotated
from pdserve.kernels.triton_utils import device_num_sms, pdl_wait

LOG2E = 1.4426950408889634
MAX_SPLITS = 32
"""Upper bound of the split-K heuristic."""
MIN_TOKENS_PER_SPLIT = 512
"""The heuristic gives each split at least this many tokens of the longest possible context."""


class DecodeWorkspace(NamedTuple):
    """Preallocated split-K partial results; rows beyond the current batch and splits are left unused."""

    partial_out: torch.Tensor  # [max_batch, num_heads, max_splits, head_dim] fp32, normalised per split
    partial_lse: torch.Tensor  # [max_batch, num_heads, max_splits] fp32, log2-sum-exp of the scaled scores

    @classmethod
    def allocate(
        cls, max_batch: int, num_heads: int, head_dim: int, max_splits: int, device: torch.device | str
    ) -> DecodeWorkspace:
        out = torch.empty(max_batch, num_heads, max_splits, head_dim, dtype=torch.float32, device=device)
        lse = torch.empty(max_batch, num_heads, max_splits, dtype=torch.float32, device=device)
        return cls(out, lse)

    @property
    def max_splits(self) -> int:
        return self.partial_out.shape[2]


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per sequence so that batch * num_kv_heads * splits programs fill about two waves of SMs.

    Depends only on host-known sizes (max_context = block_tables.shape[1] * block_size), so a CUDA graph
    captured for one batch shape always replays the same split count.
    """
    num_programs = batch * num_kv_heads
    if num_programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(2 * num_sms, num_programs)
    by_length = max_context // MIN_TOKENS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


class DecodeTileConfig(NamedTuple):
    """Tile and launch shape of stage 1."""

    tile_n: int
    """Key tokens per inner-loop tile: a power of two >= 16 (each token's block is looked up)."""
    num_warps: int


def choose_decode_config(head_dim: int, group: int) -> DecodeTileConfig:
    """The fastest tiles of a sweep (scripts/tune_decode_attention.py).

    With one or two query heads per KV head the [16, head_dim] query tile is mostly padding and a program
    does little work: one warp and 32-token tiles keep more programs resident. Wider GQA groups take 128-token
    tiles.
    """
    if group <= 2:
        return DecodeTileConfig(32, 1)
    return DecodeTileConfig(128 if head_dim <= 128 else 32, 4)


@triton.jit
def _attend_tiles(
    acc,  # [GROUP_PAD, HEAD_DIM] fp32, unnormalised output
    l_i,  # [GROUP_PAD] fp32 running sum of exp2
    m_i,  # [GROUP_PAD] fp32 running max, log2 domain
    q,  # [GROUP_PAD, HEAD_DIM]
    k_base,  # k_ptr at this KV head
    v_base,
    bt_row,  # block table row of this sequence
    seq_len,
    tile_start,
    tile_end,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over key tiles [tile_start, tile_end), each token's block looked up in the table."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    for tile in range(tile_start, tile_end):
        pos = tile * TILE_N + offs_n  # [TILE_N] token positions
        valid = pos < seq_len
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k_off = block * stride_kb + slot * stride_kt  # [TILE_N]
        v_off = block * stride_vb + slot * stride_vt
        k = tl.load(k_base + k_off[None, :] + offs_d[:, None], mask=valid[None, :], other=0.0)  # [HEAD_DIM, TILE_N]
        v = tl.load(v_base + v_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)  # [TILE_N, HEAD_DIM]

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [GROUP_PAD, TILE_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        # every tile holds at least one valid token, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_splits", "max_blocks", "stride_bt"])  # per pass, see jit_watch
def _decode_stage1(
    q_ptr,  # [batch, num_heads, head_dim]
    k_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_ptr,
    block_tables_ptr,  # [batch, max_blocks] int32
    seq_lens_ptr,  # [batch] int32
    out_ptr,  # [batch, num_heads, head_dim], written when not SPLIT
    part_out_ptr,  # [>= batch, num_heads, >= num_splits, head_dim] fp32, written when SPLIT
    part_lse_ptr,  # [>= batch, num_heads, >= num_splits] fp32, written when SPLIT
    cos_ptr,  # ROPE: [max_positions, head_dim] rope tables for q
    sin_ptr,
    qk_scale,  # softmax scale * log2(e)
    num_splits,
    max_blocks,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_cos,
    max_positions,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    ROPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # a length beyond the block table (or below 0) is clamped, so no read leaves the table.
    seq_len = tl.load(seq_lens_ptr + seq)
    seq_len = tl.minimum(tl.maximum(seq_len, 0), max_blocks * BLOCK_SIZE)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g  # [GROUP_PAD] query heads of this kv head
    g_mask = offs_g < GROUP
    q_rows = q_ptr + seq * stride_qb + heads * stride_qh  # [GROUP_PAD]
    if ROPE:  # the query is the sequence's last token
        pos = tl.full([GROUP_PAD], 0, tl.int32) + seq_len - 1
        q = load_rotated(q_rows, g_mask, pos, cos_ptr, sin_ptr, stride_cos, max_positions, HEAD_DIM, HEAD_DIM)
    else:
        q = tl.load(q_rows[:, None] + offs_d[None, :], mask=g_mask[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max, log2 domain
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh, bt_row, seq_len,
        tile_start, tile_end, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt,
        HEAD_DIM, BLOCK_SIZE, TILE_N, DOT_PRECISION,
    )  # fmt: skip

    _store_output(
        acc, l_i, m_i, heads, g_mask, seq, split, out_ptr, part_out_ptr, part_lse_ptr,
        stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, HEAD_DIM, SPLIT,
    )  # fmt: skip


@triton.jit
def _store_output(
    acc,  # [GROUP_PAD, HEAD_DIM] fp32
    l_i,  # [GROUP_PAD] fp32
    m_i,  # [GROUP_PAD] fp32, log2 domain
    heads,  # [GROUP_PAD] query heads
    g_mask,  # [GROUP_PAD] real heads (not padding)
    seq,
    split,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The normalised output, or with SPLIT this split's partial output and its log2-sum-exp."""
    offs_d = tl.arange(0, HEAD_DIM)
    # an empty range (seq_len 0, or a split past the end) leaves l_i = 0: write zeros, never NaN
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if SPLIT:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        p_off = seq * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + p_off[:, None] + offs_d[None, :], o, mask=g_mask[:, None])
        tl.store(part_lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=g_mask)
    else:
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_stage2(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + seq * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # all splits empty (seq_len 0) gives lse_max = -inf; shifting by 0 keeps every weight exactly 0
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)  # [SPLITS_PAD]
    part = tl.load(
        part_out_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_mask[:, None],
        other=0.0,
    )  # [SPLITS_PAD, HEAD_DIM]
    total = tl.sum(weight, axis=0)
    o = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


def _check_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    batch, num_heads, head_dim = q.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, num_blocks, block_size, kv_heads, d]"
    _, _, block_size, num_kv_heads, kv_head_dim = kv_cache.shape
    assert kv_head_dim == head_dim, f"head_dim mismatch: q {head_dim}, kv_cache {kv_head_dim}"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 16, got {head_dim}"
    assert block_size & (block_size - 1) == 0 and block_size <= 256, "block_size must be a power of two <= 256"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
    assert kv_cache.dtype == q.dtype, f"dtype mismatch: q {q.dtype}, kv_cache {kv_cache.dtype}"
    assert q.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim must be the contiguous dimension"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == batch
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (batch,)


def paged_decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks] int32, padded with the null block 0
    seq_lens: torch.Tensor,  # [batch] int32, current token included
    scale: float,
    out: torch.Tensor | None = None,  # [batch, num_heads, head_dim], written in place
    num_splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    cfg: DecodeTileConfig | None = None,
    rope: RopeTables | None = None,  # rotate q (at position seq_lens - 1) as it is loaded
    pdl: bool = False,
) -> torch.Tensor:  # [batch, num_heads, head_dim], q's dtype unless `out` says otherwise
    """Attention of one new query per sequence over its paged K/V; sequences of length 0 give zeros.

    num_splits: split-K partitions of each sequence's context; None picks choose_num_splits(...) (capped at
    the workspace's max_splits when one is given). With more than one split the partial results go to
    `workspace`, allocated here when None. With pdl (triton_utils.use_pdl), both stages are programmatic dependent
    launches.
    """
    _check_inputs(q, kv_cache, block_tables, seq_lens)
    batch, num_heads, head_dim = q.shape
    if rope is not None:
        check_tables(rope, head_dim, q.dtype)
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    max_blocks = block_tables.shape[1]
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1, "out must be [batch, num_heads, head_dim], last dim contiguous"
    if num_splits is None:
        num_splits = _default_splits(q, num_kv_heads, max_blocks * block_size, workspace)
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    if batch == 0:
        return out
    split = num_splits > 1
    part_out, part_lse = _split_buffers(q, out, num_splits, workspace) if split else (out, out)  # unused unsplit
    cfg = cfg or choose_decode_config(head_dim, num_heads // num_kv_heads)
    assert cfg.tile_n >= 16 and cfg.tile_n & (cfg.tile_n - 1) == 0, f"tile_n must be a power of two >= 16: {cfg}"
    _launch_stage1(q, kv_cache, block_tables, seq_lens, scale, out, part_out, part_lse, num_splits, cfg, rope, pdl)
    if split:
        _merge_splits(part_out, part_lse, out, num_splits, pdl)
    return out


def _launch_stage1(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    num_splits: int,
    cfg: DecodeTileConfig,
    rope: RopeTables | None,
    pdl: bool,
) -> None:
    """_decode_stage1 over (sequence, KV head, split): into out, or with splits into part_out / part_lse."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads, max_blocks = kv_cache.shape[2], kv_cache.shape[3], block_tables.shape[1]
    group, split = num_heads // num_kv_heads, num_splits > 1
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    cos, sin = rope if rope is not None else (q, q)  # unread without rope
    _decode_stage1[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, cos, sin,
        scale * LOG2E, num_splits, max_blocks,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if split else 0,
        part_lse.stride(0), part_lse.stride(1),
        cos.stride(0) if rope is not None else 0, cos.shape[0] if rope is not None else 1,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_N=cfg.tile_n,
        SPLIT=split,
        ROPE=rope is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PDL=pdl,
        num_warps=cfg.num_warps,
        launch_pdl=pdl,
    )  # fmt: skip


def _default_splits(q: torch.Tensor, num_kv_heads: int, max_context: int, workspace: DecodeWorkspace | None) -> int:
    """choose_num_splits for q's batch on q's device, capped at the workspace's max_splits when one is given."""
    num_splits = choose_num_splits(q.shape[0], num_kv_heads, max_context, device_num_sms(q.device))
    return num_splits if workspace is None else min(num_splits, workspace.max_splits)


def _split_buffers(
    q: torch.Tensor, out: torch.Tensor, num_splits: int, workspace: DecodeWorkspace | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The workspace's (partial_out, partial_lse), checked against the batch; allocated when None."""
    batch, num_heads, head_dim = q.shape
    if workspace is None:
        workspace = DecodeWorkspace.allocate(batch, num_heads, head_dim, num_splits, q.device)
    part_out, part_lse = workspace
    assert part_out.shape[0] >= batch and part_out.shape[1:] == (num_heads, workspace.max_splits, head_dim)
    assert part_lse.shape[0] >= batch and part_lse.shape[1:] == (num_heads, workspace.max_splits)
    assert num_splits <= workspace.max_splits, f"num_splits {num_splits} > workspace {workspace.max_splits}"
    assert part_out.stride(3) == 1 and part_lse.stride(2) == 1
    return part_out, part_lse


def _merge_splits(
    part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_splits: int, pdl: bool
) -> None:
    """Stage 2: each (sequence, head) output from its splits' partial results."""
    batch, num_heads, head_dim = out.shape
    _decode_stage2[(batch, num_heads)](
        part_out, part_lse, out, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip


def paged_decode_attention_ref(
    q: torch.Tensor,  # [batch, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    seq_lens: torch.Tensor,  # [batch] int32
    scale: float,
) -> torch.Tensor:  # [batch, num_heads, head_dim] fp32; rows of length-0 sequences are zero
    """Torch reference: gathers every sequence's keys densely and runs a masked softmax in fp32."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    pos = torch.arange(block_tables.shape[1] * block_size, device=q.device)  # [max_seq]
    blocks = block_tables.long()[:, pos // block_size]  # [batch, max_seq]
    keys = kv_cache[0][blocks, pos % block_size].float()  # [batch, max_seq, kv_heads, head_dim]
    values = kv_cache[1][blocks, pos % block_size].float()
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=2)  # [batch, max_seq, num_heads, head_dim]
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bshd->bhs", q.float(), keys) * scale  # [batch, num_heads, max_seq]
    valid = (pos[None, :] < seq_lens.long()[:, None])[:, None, :]  # [batch, 1, max_seq]
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # length-0 rows: all -inf -> NaN -> 0
    return torch.einsum("bhs,bshd->bhd", probs, values)
