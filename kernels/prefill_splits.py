"""Split-KV for short prefill passes over long cached prefixes: prefix hits, chat turns, the last chunks of a
chunked prefill.

The prefill kernel runs one program per (query head, query tile, sequence), and each walks its sequence's
whole cached prefix alone. A pass of few new tokens has few programs: 104 new tokens after a 896-token cached
prefix are 64 programs (32 heads x 2 tiles) on a 132-SM GPU, each walking 14 key tiles in a row. A pass of at
most SPLIT_MAX_TOKENS tokens with a prefix of SPLIT_MIN_PREFIX tokens or more (choose_num_splits, on the host:
kernels/split_policy.py) launches NUM_SPLITS programs per (head, tile, sequence); each sequence splits its
cached prefix on the device (`split_range`) into at most NUM_SPLITS ranges of at least MIN_SPLIT_TILES key
tiles, so a sequence with a short prefix or none runs one split, which writes `out` as an unsplit pass does,
and the surplus programs return at once. Several splits write a normalised partial output and its
log2-sum-exp to a PrefillWorkspace, and `merge_splits` combines them into `out`; the last split also attends
the new tokens.

NOTE: the surplus programs are not free: a graphed 128-token pass has 8 sequence slots, so 4096 programs
instead of 512. Splitting every pass of few tokens cost a 104-token prompt with no prefix 0.33 ms on an H100
(1B Llama shape, 15 layers), more than it saved over a 896-token prefix; over 4000 and 7936 tokens it saved 0.7
and 1.6 ms (bench/results/prefix_hits_h100_2026-11-25_always_split.json). Hence the host's choice, which
prefill graphs follow with a split variant of each size up to SPLIT_MAX_TOKENS (as shipped: 2048 / 4000 / 7936
cached tokens + ~100 new, 3.12 / 3.61 / 5.60 ms unsplit -> 2.90 / 3.28 / 3.56 ms split, no change without a
prefix; prefix_hits_h100_2026-11-25.json). Each sequence's ranges are derived on the device from its lengths,
so a graph replays right for any prefix.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels.split_policy import MIN_SPLIT_TILES, NUM_SPLITS


class PrefillWorkspace(NamedTuple):
    """Partial results of split passes, indexed by split and the pass's flat token row."""

    partial_out: torch.Tensor  # [num_splits, max_tokens, num_heads, head_dim] fp32, normalised per split
    partial_lse: torch.Tensor  # [num_splits, max_tokens, num_heads] fp32, log2-sum-exp of the scaled scores

    @classmethod
    def allocate(cls, max_tokens: int, num_heads: int, head_dim: int, device: torch.device | str) -> PrefillWorkspace:
        out = torch.empty(NUM_SPLITS, max_tokens, num_heads, head_dim, dtype=torch.float32, device=device)
        lse = torch.empty(NUM_SPLITS, max_tokens, num_heads, dtype=torch.float32, device=device)
        return cls(out, lse)

    def fits(self, q: torch.Tensor) -> bool:
        """Whether a pass with this q ([num_tokens, num_heads, head_dim]) can write its partials here."""
        num_tokens, num_heads, head_dim = q.shape
        part = self.partial_out
        return part.shape[1] >= num_tokens and part.shape[2:] == (num_heads, head_dim) and part.device == q.device


@triton.jit
def cached_prefix_len(seq_lens_ptr, seq, q_len, max_seq_len):
    """Tokens of the sequence before its first query; seq_len is clamped to the block table's capacity
    (max_seq_len), so no read leaves the table. The prefill and merge kernels must agree on it."""
    return tl.maximum(tl.minimum(tl.load(seq_lens_ptr + seq), max_seq_len) - q_len, 0)


@triton.jit
def split_range(ctx_len, split, num_splits, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """(splits used, first key, end key) of `split`'s share of a ctx_len-token cached prefix.

    Splits of equal whole tiles, none empty; one split (0, ctx_len) with num_splits 1 or a short prefix.
    """
    ctx_tiles = tl.cdiv(ctx_len, BLOCK_N)
    used = tl.minimum(tl.maximum(ctx_tiles // MIN_TILES, 1), num_splits)
    per_split = tl.cdiv(ctx_tiles, used)  # 0 without a prefix
    used = tl.maximum(tl.cdiv(ctx_tiles, tl.maximum(per_split, 1)), 1)
    lo = split * per_split * BLOCK_N
    return used, lo, tl.minimum(lo + per_split * BLOCK_N, ctx_len)


@triton.jit
def store_partial(
    acc,  # [BLOCK_M, HEAD_DIM] fp32, unnormalised output over this split's keys
    l_i,  # [BLOCK_M] fp32, >= 1 on every stored row (its range's largest score gives exp2(0))
    m_i,  # [BLOCK_M] fp32, log2 domain
    rows,  # [BLOCK_M] int64 flat token rows
    row_mask,
    head,
    split,
    part_out_ptr,
    part_lse_ptr,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    HEAD_DIM: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    p_ptrs = part_out_ptr + split * stride_ps + rows[:, None] * stride_pt + head * stride_ph + offs_d[None, :]
    tl.store(p_ptrs, acc / l_i[:, None], mask=row_mask[:, None])
    tl.store(part_lse_ptr + split * stride_ls + rows * stride_lt + head, m_i + tl.log2(l_i), mask=row_mask)


@triton.jit(do_not_specialize=["num_splits", "max_seq_len"])  # NOTE: per pass, see jit_watch
def _merge_kernel(
    part_out_ptr,  # [num_splits, max_tokens, num_heads, head_dim] fp32
    part_lse_ptr,  # [num_splits, max_tokens, num_heads] fp32
    query_start_loc_ptr,  # [batch + 1] int32
    seq_lens_ptr,  # [batch] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    num_splits,
    max_seq_len,  # the block table's capacity in tokens (see cached_prefix_len)
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    start_m = tl.program_id(1) * BLOCK_M
    if start_m >= q_len:
        return
    ctx_len = cached_prefix_len(seq_lens_ptr, seq, q_len, max_seq_len)
    used, _, _ = split_range(ctx_len, 0, num_splits, BLOCK_N, MIN_TILES)
    if used == 1:  # the one split wrote the output itself
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_mask = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for split in range(0, used):
        lse = tl.load(part_lse_ptr + split * stride_ls + rows * stride_lt + head, mask=row_mask, other=0.0)
        p_ptrs = part_out_ptr + split * stride_ps + rows[:, None] * stride_pt + head * stride_ph + offs_d[None, :]
        part = tl.load(p_ptrs, mask=row_mask[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + part * weight[:, None]
        total = total * alpha + weight
        m = m_new
    o_ptrs = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def merge_splits(
    workspace: PrefillWorkspace,
    query_start_loc: torch.Tensor,  # [batch + 1] int32
    seq_lens: torch.Tensor,  # [batch] int32
    max_seq_len: int,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    num_splits: int,
    grid: tuple[int, int, int],  # the prefill kernel's (num_heads, query tiles, batch)
    block_m: int,
    block_n: int,
) -> None:
    """Each split row's output from its splits' partial results (rows of one-split sequences are left as is)."""
    part_out, part_lse = workspace
    _merge_kernel[grid](
        part_out, part_lse, query_start_loc, seq_lens, out, num_splits, max_seq_len,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=out.shape[2],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        MIN_TILES=MIN_SPLIT_TILES,
        num_warps=4,
    )  # fmt: skip
