"""The prefill kernel's tile walks (kernels/prefill_attention.py): the online-softmax step, the cached prefix's
key tiles gathered through the block table, the pass's own new keys (TMA or pointer loads), and the query tile.

Shapes as in kernels/prefill_attention.py; the softmax runs in fp32 in the log2 domain.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(
    acc,  # [BLOCK_M, HEAD_DIM] fp32, unnormalised output
    l_i,  # [BLOCK_M] fp32 running sum of exp2
    m_i,  # [BLOCK_M] fp32 running max, log2 domain
    q,  # [BLOCK_M, HEAD_DIM]
    k,  # [BLOCK_N, HEAD_DIM]
    v,  # [BLOCK_N, HEAD_DIM]
    visible,  # [BLOCK_M, BLOCK_N] bool, used only when MASKED
    qk_scale,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    # every row sees key 0 in the first tile it runs, so m_new is finite
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_prefix_tiles(
    acc,
    l_i,
    m_i,
    q,  # [BLOCK_M, HEAD_DIM]
    k_base,  # k_cache at this KV head
    v_base,
    bt_row,  # block table row of this sequence
    n_start,
    n_end,  # the cached prefix's length: every query row sees all of it
    qk_scale,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Keys [n_start, n_end) of the cached prefix, gathered through the block table."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(n_start, n_end, BLOCK_N):
        k_pos = start_n + offs_n  # [BLOCK_N] key token positions
        # NOTE: unmasked tiles lie wholly below n_end, so only the masked tail tile needs load masks.
        in_range = k_pos < n_end
        if MASKED:
            block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        else:
            block = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
        slot = k_pos % BLOCK_SIZE
        k_ptrs = k_base + (block * stride_kb + slot * stride_kt)[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
        v_ptrs = v_base + (block * stride_vb + slot * stride_vt)[:, None] + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        visible = tl.broadcast_to(in_range[None, :], (BLOCK_M, BLOCK_N))
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, k, v, visible, qk_scale, MASKED, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attend_new_tiles(
    acc,
    l_i,
    m_i,
    q,  # [BLOCK_M, HEAD_DIM]
    offs_m,  # [BLOCK_M] query rows within the sequence (= new-key index of the row's own token)
    k_new,  # TMA: descriptor of [num_tokens, kv_heads * head_dim]; else pointer to [num_tokens, kv_heads, d]
    v_new,
    row0,  # this sequence's first row in the flat batch
    col,  # kv_head * HEAD_DIM
    n_start,
    n_end,  # new keys [n_start, n_end), indexed within the sequence's new tokens
    qk_scale,
    stride_nkt,
    stride_nvt,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The pass's own new keys, read from the contiguous K/V rows the model just computed (not the cache).

    Masked tiles hold the diagonal: row r sees key j <= r. With TMA, rows past the sequence belong to the next
    sequence (or are zero past the tensor): only rows that are never stored can see them.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # NOTE: a third K/V stage in this loop alone (the long one of a long prompt): 4000 tokens on an H200, in the
    # model, 0.06 ms less per pass than the kernel's two stages (standalone, cold L2: 195 -> 182 us per layer)
    for start_n in tl.range(n_start, n_end, BLOCK_N, num_stages=3):
        j = start_n + offs_n  # [BLOCK_N]
        if TMA:
            k = k_new.load([row0 + start_n, col])
            v = v_new.load([row0 + start_n, col])
        else:
            rows = (row0 + j).to(tl.int64)
            k_ptrs = k_new + rows[:, None] * stride_nkt + col + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
            v_ptrs = v_new + rows[:, None] * stride_nvt + col + offs_d[None, :]
            if MASKED:
                k = tl.load(k_ptrs, mask=(j < n_end)[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=(j < n_end)[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
        visible = j[None, :] <= offs_m[:, None]
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, k, v, visible, qk_scale, MASKED, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def load_q(
    q_in,  # TMA descriptor of [num_tokens, num_heads * head_dim], or pointer to [num_tokens, num_heads, d]
    q_rows,  # [BLOCK_M] int64 rows in the flat batch
    row_mask,  # [BLOCK_M] rows of this sequence
    first_row,  # q_rows[0]
    col,  # head * HEAD_DIM
    stride_qt,
    HEAD_DIM: tl.constexpr,
    TMA: tl.constexpr,
):
    """The query tile [BLOCK_M, HEAD_DIM]; with TMA, rows past the sequence hold the next one's (never stored)."""
    if TMA:
        q = q_in.load([first_row, col])
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_in + q_rows[:, None] * stride_qt + col + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    return q


@triton.jit
def attend_prefix(
    q,  # [BLOCK_M, HEAD_DIM]
    k_base,  # k_cache at this KV head
    v_base,
    bt_row,  # block table row of this sequence
    lo,  # keys [lo, hi) of the cached prefix (lo a multiple of BLOCK_N; hi <= the prefix's length)
    hi,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fresh softmax state (acc, l_i, m_i) after prefix keys [lo, hi): full tiles unmasked, the tail masked."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end = lo + (hi - lo) // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _attend_prefix_tiles(
        acc, l_i, m_i, q, k_base, v_base, bt_row, lo, full_end, qk_scale,
        stride_kb, stride_kt, stride_vb, stride_vt,
        HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE, False, DOT_PRECISION,
    )  # fmt: skip
    return _attend_prefix_tiles(
        acc, l_i, m_i, q, k_base, v_base, bt_row, full_end, hi, qk_scale,
        stride_kb, stride_kt, stride_vb, stride_vt,
        HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE, True, DOT_PRECISION,
    )  # fmt: skip


@triton.jit
def attend_new(
    acc,
    l_i,
    m_i,
    q,  # [BLOCK_M, HEAD_DIM]
    offs_m,  # [BLOCK_M] query rows within the sequence
    k_new,
    v_new,
    row0,  # this sequence's first row in the flat batch
    col,  # kv_head * HEAD_DIM
    start_m,  # the query tile's first row
    q_len,
    qk_scale,
    stride_nkt,
    stride_nvt,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The new keys up to the tile's last row: [0, full_end) visible to every row, then the diagonal."""
    full_end = (start_m + 1) // BLOCK_N * BLOCK_N
    new_end = tl.minimum(start_m + BLOCK_M, q_len)
    acc, l_i, m_i = _attend_new_tiles(
        acc, l_i, m_i, q, offs_m, k_new, v_new, row0, col, 0, full_end, qk_scale, stride_nkt, stride_nvt,
        HEAD_DIM, BLOCK_N, False, TMA, DOT_PRECISION,
    )  # fmt: skip
    return _attend_new_tiles(
        acc, l_i, m_i, q, offs_m, k_new, v_new, row0, col, full_end, new_end, qk_scale, stride_nkt, stride_nvt,
        HEAD_DIM, BLOCK_N, True, TMA, DOT_PRECISION,
    )  # fmt: skip


@triton.jit
def new_token_inputs(
    q_ptr,
    k_new_ptr,
    v_new_ptr,
    num_tokens,
    num_heads,
    num_kv_heads,
    stride_qt,
    stride_nkt,
    stride_nvt,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
):
    """The new tokens' q, K and V as the loads take them: with TMA, descriptors of [num_tokens, heads * head_dim]
    (one head per box) made on the device, so a launch pays no host-side encoding; else the pointers."""
    if TMA:
        q_in = tl.make_tensor_descriptor(q_ptr, [num_tokens, num_heads * HEAD_DIM], [stride_qt, 1], [BLOCK_M, HEAD_DIM])
        kv_shape = [num_tokens, num_kv_heads * HEAD_DIM]
        k_in = tl.make_tensor_descriptor(k_new_ptr, kv_shape, [stride_nkt, 1], [BLOCK_N, HEAD_DIM])
        v_in = tl.make_tensor_descriptor(v_new_ptr, kv_shape, [stride_nvt, 1], [BLOCK_N, HEAD_DIM])
    else:
        q_in, k_in, v_in = q_ptr, k_new_ptr, v_new_ptr
    return q_in, k_in, v_in


# NOTE: per pass (see jit_watch), or per workspace: the split partials' strides, read only by split passes
