"""Prefill attention in Triton: flash-style, varlen, causal, GQA, over a cached prefix (paged) plus new tokens.

Layouts follow kernels/attention.py: q is the flat [num_tokens, num_heads, head_dim] batch of new tokens;
sequence i owns rows query_start_loc[i]:query_start_loc[i+1], which sit at the last query_len positions of
its seq_lens[i] tokens. k_new/v_new are the same tokens' K/V, [num_tokens, num_kv_heads, head_dim] (the rows
the model just computed; the backend has also appended them to the cache). kv_cache is [2, num_blocks,
block_size, num_kv_heads, head_dim] (0 = K, 1 = V) and holds each sequence's cached prefix: position p lives at
kv_cache[:, block_tables[i, p // block_size], p % block_size]. Block tables are padded with the null block 0.

One program runs per (query head, tile of BLOCK_M query rows, sequence); query head h reads KV head
h // (num_heads // num_kv_heads). It walks the keys in tiles of BLOCK_N tokens with an online softmax in fp32
in the log2 domain: first the cached prefix (gathered through the block table, visible to every row), then
the new tokens, read as contiguous rows (through TMA descriptors on Hopper-class GPUs for 16-bit types,
made on the device by each program, so a launch pays no host-side descriptor encoding):
tiles before the query tile's first row run unmasked, the few on the diagonal with the causal mask, and keys
beyond are skipped. Reading new keys from k_new/v_new rather than the cache drops the per-key block-table
gather from the long-prompt case, where nearly every key is new. The heads are the fastest grid axis, so the
G query heads of one KV head run side by side and share K/V through L2; query tiles are issued last-first,
so the longest (most keys) programs start first. A pass of few tokens splits long cached prefixes across
programs (split-KV, kernels/prefill_splits.py).

The launch reads no device value on the host (max_query_len is a host int that sizes the grid;
query lengths and seq_lens are read inside the kernel) and, given `out` and `workspace`, allocates only the
TMA descriptors' scratch (from torch's caching allocator through triton.set_allocator; a capture keeps it in
the graph's pool), so a CUDA graph can capture it. A graph replays the grid of its captured max_query_len:
rows past it would stay unwritten.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels.prefill_splits import PrefillWorkspace, cached_prefix_len, merge_splits, split_range, store_partial
from pdserve.kernels.prefill_tiles import attend_new, attend_prefix, load_q, new_token_inputs
from pdserve.kernels.split_policy import MIN_SPLIT_TILES
from pdserve.kernels.triton_utils import set_triton_allocator

LOG2E = 1.4426950408889634
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256


class PrefillTileConfig(NamedTuple):
    """Tile sizes and launch shape of the prefill kernel."""

    block_m: int
    """Query rows per program."""
    block_n: int
    """Key tokens per inner-loop tile."""
    num_warps: int
    num_stages: int


def choose_tile_config(head_dim: int, dtype: torch.dtype, max_query_len: int) -> PrefillTileConfig:
    """Tiles for a head_dim and dtype; BLOCK_M shrinks for short queries (decode-like batches).

    fp32 runs its dots on IEEE FMAs (no tensor cores), so it takes smaller tiles; 16-bit types take the
    shapes that timed fastest for 4000-token prefills at head_dim 64 and 128, bounded so K/V stages fit
    shared memory. They are timed inside the model: tiles that win a standalone sweep
    (scripts/tune_prefill_attention.py, warm L2) can lose there.
    """
    if dtype == torch.float32:
        cfg = PrefillTileConfig(64, 32, 4, 2) if head_dim <= 128 else PrefillTileConfig(32, 32, 4, 1)
    elif head_dim <= 64:
        cfg = PrefillTileConfig(64, 64, 4, 2)
    elif head_dim <= 128:
        cfg = PrefillTileConfig(64, 64, 4, 3)
    else:
        cfg = PrefillTileConfig(64, 32, 4, 2)
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(max(max_query_len, 1))))
    return cfg._replace(block_m=block_m)


@triton.jit(
    do_not_specialize=[
        "max_blocks", "num_tokens", "stride_bt", "num_splits",
        "stride_ps", "stride_pt", "stride_ph", "stride_ls", "stride_lt",
    ]
)  # fmt: skip
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim], rows strided
    k_new_ptr,  # [num_tokens, num_kv_heads, head_dim]: the new tokens' K, rows strided
    v_new_ptr,
    k_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]: the cache, for cached prefixes
    v_ptr,
    block_tables_ptr,  # [batch, max_blocks] int32
    query_start_loc_ptr,  # [batch + 1] int32
    seq_lens_ptr,  # [batch] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_splits, max_tokens, num_heads, head_dim] fp32 (kernels/prefill_splits.py), split passes
    part_lse_ptr,  # [num_splits, max_tokens, num_heads] fp32
    qk_scale,  # softmax scale * log2(e)
    group,  # num_heads // num_kv_heads
    max_blocks,
    num_tokens,
    num_heads,
    num_splits,  # programs per (head, query tile, sequence) on grid axis 2; 1: no split
    stride_qt,
    stride_nkt,
    stride_nvt,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MIN_TILES: tl.constexpr,  # MIN_SPLIT_TILES
):
    head = tl.program_id(0)
    m_tile = tl.num_programs(1) - 1 - tl.program_id(1)  # last tiles (most keys) first
    seq = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    start_m = m_tile * BLOCK_M
    if start_m >= q_len:
        return
    ctx_len = cached_prefix_len(seq_lens_ptr, seq, q_len, max_blocks * BLOCK_SIZE)
    used, lo, hi = split_range(ctx_len, split, num_splits, BLOCK_N, MIN_TILES)
    if split >= used:
        return
    kv_head = head // group
    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows within the sequence
    row_mask = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q_in, k_new, v_new = new_token_inputs(
        q_ptr, k_new_ptr, v_new_ptr, num_tokens, num_heads, num_heads // group, stride_qt, stride_nkt, stride_nvt,
        HEAD_DIM, BLOCK_M, BLOCK_N, TMA,
    )  # fmt: skip
    q = load_q(q_in, q_rows, row_mask, q_start + start_m, head * HEAD_DIM, stride_qt, HEAD_DIM, TMA)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc, l_i, m_i = attend_prefix(
        q, k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh, bt_row, lo, hi, qk_scale,
        stride_kb, stride_kt, stride_vb, stride_vt, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE, DOT_PRECISION,
    )  # fmt: skip
    if split == used - 1:  # the last split also takes the new tokens
        acc, l_i, m_i = attend_new(
            acc, l_i, m_i, q, offs_m, k_new, v_new, q_start, kv_head * HEAD_DIM, start_m, q_len, qk_scale,
            stride_nkt, stride_nvt, HEAD_DIM, BLOCK_M, BLOCK_N, TMA, DOT_PRECISION,
        )  # fmt: skip
    if used > 1:
        store_partial(
            acc, l_i, m_i, q_rows, row_mask, head, split, part_out_ptr, part_lse_ptr,
            stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, HEAD_DIM,
        )  # fmt: skip
    else:
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + tl.arange(0, HEAD_DIM)[None, :]
        o = acc / l_i[:, None]  # every stored row saw its own key: l_i >= 1
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _check_inputs(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
) -> None:
    assert q.dim() == 3, "q must be [num_tokens, num_heads, head_dim]"
    num_tokens, num_heads, head_dim = q.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, num_blocks, block_size, kv_heads, d]"
    _, _, block_size, num_kv_heads, kv_head_dim = kv_cache.shape
    assert kv_head_dim == head_dim, f"head_dim mismatch: q {head_dim}, kv_cache {kv_head_dim}"
    assert MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0, (
        f"head_dim must be a power of two in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}"
    )
    assert block_size > 0 and block_size & (block_size - 1) == 0, f"block_size must be a power of two, got {block_size}"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {q.dtype}"
    assert kv_cache.dtype == q.dtype, f"dtype mismatch: q {q.dtype}, kv_cache {kv_cache.dtype}"
    for name, t, heads in (("q", q, num_heads), ("k_new", k_new, num_kv_heads), ("v_new", v_new, num_kv_heads)):
        assert t.shape == (num_tokens, heads, head_dim), f"{name} must be [{num_tokens}, {heads}, {head_dim}]"
        assert t.dtype == q.dtype, f"dtype mismatch: q {q.dtype}, {name} {t.dtype}"
        contiguous = t.stride(2) == 1 and t.stride(1) == head_dim
        assert contiguous or t.numel() == 0, f"{name}: heads and head_dim must be contiguous"
    assert kv_cache.stride(4) == 1, "kv_cache: head_dim must be the contiguous dimension"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2, "block_tables must be [batch, max_blocks] i32"
    batch = block_tables.shape[0]
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (batch + 1,), "query_start_loc: [batch+1]"
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous(), "query_start_loc, seq_lens: contiguous"
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (batch,), "seq_lens must be [batch] int32"
    assert 0 <= max_query_len <= num_tokens, f"max_query_len {max_query_len} outside [0, {num_tokens}]"


def tma_supported(*tensors: torch.Tensor) -> bool:
    """Whether the new tokens' q/K/V can be read through TMA descriptors: a Hopper-class GPU, 16-bit types,
    16-byte aligned bases and row strides."""
    t0 = tensors[0]
    if not t0.is_cuda or t0.dtype == torch.float32 or torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in tensors)


def launch_prefill_kernel(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_new: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v_new: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    query_start_loc: torch.Tensor,  # [batch + 1] int32
    seq_lens: torch.Tensor,  # [batch] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cfg: PrefillTileConfig,
    tma: bool,
    num_splits: int = 1,
    workspace: PrefillWorkspace | None = None,  # required with num_splits > 1 (unread without)
) -> None:
    """Launches the kernel (and the split merge) with explicit tiles and splits; inputs are assumed checked."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    batch, max_blocks = block_tables.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_heads, triton.cdiv(max_query_len, cfg.block_m), batch)
    if workspace is None:  # fp32 partials even where unread, so split and unsplit passes share one variant
        assert num_splits == 1, "a split pass needs a workspace"
        workspace = PrefillWorkspace.allocate(1, num_heads, head_dim, q.device)
    assert num_splits == 1 or workspace.fits(q), "the workspace is too small for this pass"
    assert num_splits <= workspace.partial_out.shape[0], f"num_splits {num_splits} > the workspace's"
    part_out, part_lse = workspace
    if tma:
        set_triton_allocator()
    _prefill_kernel[grid[0], grid[1], batch * num_splits](
        q, k_new, v_new, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, part_out, part_lse,
        scale * LOG2E, num_heads // num_kv_heads, max_blocks, q.shape[0], num_heads, num_splits,
        q.stride(0), k_new.stride(0), v_new.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        TMA=tma,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        MIN_TILES=MIN_SPLIT_TILES,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(
            workspace, query_start_loc, seq_lens, max_blocks * block_size, out, num_splits, grid, cfg.block_m,
            cfg.block_n,
        )  # fmt: skip


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]  new query tokens of all sequences, flat
    k_new: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]  the same tokens' K (also already in kv_cache)
    v_new: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]  (0 = K, 1 = V)
    block_tables: torch.Tensor,  # [batch, max_blocks] int32, padded with the null block 0
    query_start_loc: torch.Tensor,  # [batch + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [batch] int32, tokens of each sequence after this pass (cached prefix + new)
    max_query_len: int,  # host int: max of the query lengths (sizes the grid)
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], written in place
    num_splits: int = 1,  # programs per (head, query tile, sequence): see kernels/prefill_splits.py
    workspace: PrefillWorkspace | None = None,  # a split pass's partials
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype unless `out` says otherwise
    """Causal attention of each sequence's new queries over its cached prefix (paged) and its new tokens.

    The new tokens' K/V are read from k_new/v_new; the prefix's from kv_cache. Requires seq_lens[i] >=
    query_len[i] and max_query_len >= every query length (shorter lengths leave rows unwritten). With
    num_splits > 1 long prefixes are split, the partials going to `workspace` (allocated here when None).
    """
    _check_inputs(q, k_new, v_new, kv_cache, block_tables, query_start_loc, seq_lens, max_query_len)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1, "out must be [num_tokens, heads, head_dim], last dim contiguous"
    if max_query_len == 0 or block_tables.shape[0] == 0:
        return out
    tma = tma_supported(q, k_new, v_new)
    cfg = choose_tile_config(q.shape[2], q.dtype, max_query_len)
    if workspace is None:
        workspace = PrefillWorkspace.allocate(q.shape[0] if num_splits > 1 else 1, q.shape[1], q.shape[2], q.device)
    launch_prefill_kernel(
        q, k_new, v_new, kv_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, out, cfg, tma,
        num_splits, workspace,
    )  # fmt: skip
    return out


def _ref_one_sequence(
    q: torch.Tensor,  # [query_len, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
    scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:  # [query_len, num_heads, head_dim] in `dtype`
    query_len, num_heads, _ = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    pos = torch.arange(seq_len, device=q.device)  # [seq_len]
    blocks = block_table.long()[pos // block_size]
    group = num_heads // num_kv_heads
    keys = kv_cache[0][blocks, pos % block_size].to(dtype).repeat_interleave(group, dim=1)  # [seq, heads, d]
    values = kv_cache[1][blocks, pos % block_size].to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), keys) * scale  # [heads, query_len, seq_len]
    q_pos = seq_len - query_len + torch.arange(query_len, device=q.device)  # [query_len]
    scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    query_start_loc: torch.Tensor,  # [batch + 1] int32
    seq_lens: torch.Tensor,  # [batch] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] fp32
    """Torch reference: per sequence, gathers its keys densely and runs a causal softmax in fp32.

    fp64 inputs are computed in fp64 (the result is still fp32), for tests that want a tighter reference.
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        begin, end = starts[i], starts[i + 1]
        if end > begin:
            out[begin:end] = _ref_one_sequence(q[begin:end], kv_cache, block_tables[i], seq_len, scale, dtype)
    return out
