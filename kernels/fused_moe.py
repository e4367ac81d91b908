"""The MoE experts' forward in Triton (core/models/moe.py's FusedExperts on CUDA): tokens sorted by expert on the
device, one grouped GEMM for every expert's gate/up with SiLU-and-mul in its epilogue, one for every expert's down
projection with the routing weight in its epilogue, and a deterministic sum over each token's top-k.

Steps of one pass (N = num_tokens * top_k assignments, row n = token n // top_k's choice n % top_k):
    align_block_size   each expert's assignments in order, padded to a multiple of block_m with the sentinel N;
                       block b of block_m slots belongs to one expert (block_experts[b])
    gate/up GEMM       inter[slot] = silu(x[token] @ gate[e]^T) * (x[token] @ up[e]^T)   [max_slots, I]
    down GEMM          terms[n] = (inter[slot] @ w2[e]^T) * weight[n]                      [N, H]
    top-k sum          out[t] = terms of token t added in ascending expert order           [num_tokens, H]

Every buffer's size and every grid depend only on (num_tokens, top_k, num_experts, block_m): the grids cover the
most blocks any routing can need (max_slots) and programs past the device-side count exit at once, so nothing is
read on the host and a CUDA graph captures the pass.

Numerics are fused_moe_ref's (the torch loop): fp32 accumulation, gate and up rounded to the dtype, SiLU in fp32
rounded once, the product rounded; the down output rounded, times the weight (float32 or the dtype) rounded; the
top-k terms added in the dtype in ascending expert order (the loop's index_add_ order). Only the GEMMs' summation
order differs from cuBLAS's. fp32 runs IEEE dots (no tf32). Sum without atomics: runs are bit-identical.

NOTE: triton is optional (the `gpu` extra); without it the module imports and only the torch reference runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from pdserve.kernels.fused_ops import silu_and_mul

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without the `gpu` extra
    triton = None  # type: ignore[assignment]


class MoeConfig(NamedTuple):
    """Tile shape of both grouped GEMMs."""

    block_m: int
    """Slots per block: each expert's assignments are padded to a multiple of it."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    """Row blocks per group of programs (L2 reuse of a weight tile across an expert's blocks)."""


CONFIGS: tuple[tuple[float, MoeConfig], ...] = (
    (8.0, MoeConfig(16, 64, 128, 4, 4)),
    (24.0, MoeConfig(32, 64, 64, 4, 4)),
    (96.0, MoeConfig(64, 128, 64, 4, 4)),
    (float("inf"), MoeConfig(128, 128, 64, 8, 3)),
)
"""(most assignments per expert on average, the config for them), first match wins: the fastest of a sweep on an
H200 at Qwen3-30B-A3B's expert shape (hidden 2048, width 768, 128 experts, top 8, bf16)."""
ALIGN_CHUNKS = (256, 4096)
"""Fewest and most assignments per step of the align kernel's scans (a power of 2 above the pass's count)."""
SUM_BLOCK = 1024
"""Hidden columns per program of the top-k sum."""


def triton_available() -> bool:
    """Whether the kernels can run (triton is installed)."""
    return triton is not None


def moe_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoeConfig:
    """The table's config for a pass; fp32 halves block_k (its tiles take twice the shared memory)."""
    per_expert = num_tokens * top_k / num_experts
    config = next(c for limit, c in CONFIGS if per_expert <= limit)
    return config._replace(block_k=config.block_k // 2) if dtype == torch.float32 else config


def max_slots(num_assign: int, num_experts: int, block_m: int) -> int:
    """Most padded slots any routing of num_assign assignments needs: at most min(N, E) experts get any,
    each padded by at most block_m - 1."""
    return num_assign + min(num_assign, num_experts) * (block_m - 1)


class Alignment(NamedTuple):
    """Assignments sorted by expert and padded to whole blocks (align_block_size)."""

    sorted_ids: Tensor  # [max_slots] int32: assignment ids (row n of experts.flatten()), N where padding
    block_experts: Tensor  # [max_slots / block_m] int32: each used block's expert
    num_slots: Tensor  # [1] int32: slots in use (a multiple of block_m); blocks past it are not written


if triton is not None:

    @triton.jit(do_not_specialize=["num_assign"])
    def _align_kernel(
        experts_ptr,  # [N] expert ids
        sorted_ids_ptr,  # [max_slots] int32
        block_experts_ptr,  # [max_slots / BM] int32
        num_slots_ptr,  # [1] int32
        num_assign,
        NUM_EXPERTS: tl.constexpr,
        E_PAD: tl.constexpr,  # a power of 2 above NUM_EXPERTS: bin NUM_EXPERTS counts the masked lanes
        BM: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """Program e: histogram of all experts -> its first slot; then its assignments in order, its padding,
        its blocks' expert ids. Every slot below num_slots is written by exactly one program."""
        e = tl.program_id(0)
        bins = tl.arange(0, E_PAD)
        lanes = tl.arange(0, CHUNK)
        counts = tl.zeros([E_PAD], dtype=tl.int32)
        for start in range(0, num_assign, CHUNK):
            ids = tl.load(experts_ptr + start + lanes, mask=start + lanes < num_assign, other=NUM_EXPERTS)
            counts += tl.histogram(ids.to(tl.int32), E_PAD)
        padded = tl.where(bins < NUM_EXPERTS, (counts + BM - 1) // BM * BM, 0)  # [E_PAD]
        first = tl.sum(tl.where(bins < e, padded, 0))
        count = tl.sum(tl.where(bins == e, counts, 0))
        num_padded = tl.sum(tl.where(bins == e, padded, 0))
        if e == 0:
            tl.store(num_slots_ptr, tl.sum(padded))
        seen = num_assign * 0  # an int32 scalar, as the loop's sums
        for start in range(0, num_assign, CHUNK):
            offs = start + lanes
            ids = tl.load(experts_ptr + offs, mask=offs < num_assign, other=NUM_EXPERTS)
            hit = (ids == e).to(tl.int32)
            rank = tl.cumsum(hit, 0)  # 1-based among this chunk's hits
            tl.store(sorted_ids_ptr + first + seen + rank - 1, offs, mask=hit > 0)
            seen += tl.sum(hit)
        pad = tl.arange(0, BM)
        tl.store(sorted_ids_ptr + first + count + pad, num_assign, mask=pad < num_padded - count)
        for b in range(0, num_padded // BM, CHUNK):
            tl.store(block_experts_ptr + first // BM + b + lanes, e, mask=b + lanes < num_padded // BM)

    @triton.jit
    def _block_of(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """(row block, column block) of a program, grouped along rows."""
        num_pid_in_group = GROUP_M * num_pid_n
        first_m = (pid // num_pid_in_group) * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        return first_m + (pid % num_pid_in_group) % size_m, (pid % num_pid_in_group) // size_m

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        if IEEE:  # noqa: SIM108 (a constexpr branch, resolved when the kernel compiles)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit(do_not_specialize=["num_assign", "num_pid_m"])
    def _gate_up_kernel(
        x_ptr,  # [num_tokens, H]
        w13_ptr,  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I)
        inter_ptr,  # [max_slots, I] contiguous
        sorted_ids_ptr,
        block_experts_ptr,
        num_slots_ptr,
        num_assign,
        num_pid_m,  # max_slots / BM
        inter_size,
        hidden,
        stride_x,
        stride_we,
        stride_wn,
        TOP_K: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        GROUP_M: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        pid_m, pid_n = _block_of(tl.program_id(0), num_pid_m, tl.cdiv(inter_size, BN), GROUP_M)
        if pid_m * BM >= tl.load(num_slots_ptr):
            return
        rows = pid_m * BM + tl.arange(0, BM)
        ids = tl.load(sorted_ids_ptr + rows)
        tokens = (ids // TOP_K).to(tl.int64)
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        a_ptrs = x_ptr + tokens[:, None] * stride_x + ks[None, :]  # [BM, BK]
        g_ptrs = w13_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BK, BN]
        u_ptrs = g_ptrs + inter_size * stride_wn
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(hidden, BK)):
            k_ok = ks < hidden - k * BK
            a = tl.load(a_ptrs, mask=(ids < num_assign)[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & (cols < inter_size)[None, :]
            acc_g = _dot(a, tl.load(g_ptrs, mask=w_ok, other=0.0), acc_g, IEEE)
            acc_u = _dot(a, tl.load(u_ptrs, mask=w_ok, other=0.0), acc_u, IEEE)
            a_ptrs += BK
            g_ptrs += BK
            u_ptrs += BK
        dtype = inter_ptr.dtype.element_ty
        g = acc_g.to(dtype).to(tl.float32)
        u = acc_u.to(dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # F.silu: fp32 math, rounded once
        out_ptrs = inter_ptr + rows[:, None].to(tl.int64) * inter_size + cols[None, :]
        tl.store(out_ptrs, (act * u).to(dtype), mask=(cols < inter_size)[None, :])

    @triton.jit(do_not_specialize=["num_assign", "num_pid_m"])
    def _down_kernel(
        inter_ptr,  # [max_slots, I] contiguous
        w2_ptr,  # [E, H, I]
        weights_ptr,  # [N] routing weights, float32 or the dtype
        terms_ptr,  # [N, H] contiguous
        sorted_ids_ptr,
        block_experts_ptr,
        num_slots_ptr,
        num_assign,
        num_pid_m,
        inter_size,
        hidden,
        stride_we,
        stride_wn,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        GROUP_M: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        pid_m, pid_n = _block_of(tl.program_id(0), num_pid_m, tl.cdiv(hidden, BN), GROUP_M)
        if pid_m * BM >= tl.load(num_slots_ptr):
            return
        rows = pid_m * BM + tl.arange(0, BM)
        ids = tl.load(sorted_ids_ptr + rows)
        valid = ids < num_assign
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        a_ptrs = inter_ptr + rows[:, None].to(tl.int64) * inter_size + ks[None, :]  # [BM, BK]
        w_ptrs = w2_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BK, BN]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(inter_size, BK)):
            k_ok = ks < inter_size - k * BK
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            acc = _dot(a, tl.load(w_ptrs, mask=k_ok[:, None] & (cols < hidden)[None, :], other=0.0), acc, IEEE)
            a_ptrs += BK
            w_ptrs += BK
        dtype = terms_ptr.dtype.element_ty
        weight = tl.load(weights_ptr + ids, mask=valid, other=0.0).to(tl.float32)  # [BM]
        term = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
        out_ptrs = terms_ptr + ids[:, None].to(tl.int64) * hidden + cols[None, :]
        tl.store(out_ptrs, term, mask=valid[:, None] & (cols < hidden)[None, :])

    @triton.jit
    def _topk_sum_kernel(
        terms_ptr,  # [num_tokens * TOP_K, H] contiguous
        experts_ptr,  # [num_tokens * TOP_K] expert ids
        out_ptr,  # [num_tokens, H] contiguous
        H,
        TOP_K: tl.constexpr,
        K_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """out[t] = the token's terms added one at a time in ascending expert order, rounded after each add."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        slots = tl.arange(0, K_PAD)
        ex = tl.load(experts_ptr + t * TOP_K + slots, mask=slots < TOP_K, other=2**30)
        rank = tl.sum((ex[None, :] < ex[:, None]).to(tl.int32), axis=1)  # [K_PAD]: the distinct experts' order
        dtype = out_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for r in tl.static_range(TOP_K):
            slot = tl.sum(tl.where(rank == r, slots, 0))
            term = tl.load(terms_ptr + (t * TOP_K + slot) * H + cols, mask=cols < H, other=0.0)
            acc = (acc + term.to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(out_ptr + t * H + cols, acc.to(dtype), mask=cols < H)


def align_block_size(
    experts: Tensor,  # [num_tokens, K]
    num_experts: int,
    block_m: int,
    chunk: int | None = None,
    num_warps: int | None = None,
) -> Alignment:
    """Sort the assignments by expert on the device (moe_align_block_size's layout): no host sync, sizes fixed
    by the shapes. chunk / num_warps: the scans' step and width (default: by the assignment count)."""
    flat = experts.reshape(-1)  # [N]
    slots = max_slots(flat.numel(), num_experts, block_m)
    alignment = Alignment(
        torch.empty(slots, dtype=torch.int32, device=flat.device),
        torch.empty(triton.cdiv(slots, block_m), dtype=torch.int32, device=flat.device),
        torch.empty(1, dtype=torch.int32, device=flat.device),
    )
    e_pad = triton.next_power_of_2(num_experts + 1)
    chunk = chunk or min(max(triton.next_power_of_2(flat.numel()), ALIGN_CHUNKS[0]), ALIGN_CHUNKS[1])
    _align_kernel[(num_experts,)](
        flat, *alignment, flat.numel(), NUM_EXPERTS=num_experts, E_PAD=e_pad, BM=block_m, CHUNK=chunk,
        num_warps=num_warps or (4 if chunk <= 1024 else 8),
    )  # fmt: skip
    return alignment


def align_block_size_ref(experts: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Torch reference of the used part of an Alignment: (sorted_ids [num_slots], block_experts [num_blocks])."""
    flat = experts.reshape(-1).cpu()
    ids, blocks = [], []
    for e in range(num_experts):
        mine = torch.nonzero(flat == e).flatten().tolist()
        padded = -(-len(mine) // block_m) * block_m
        ids += mine + [len(flat)] * (padded - len(mine))
        blocks += [e] * (padded // block_m)
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(blocks, dtype=torch.int32)


def fused_moe(
    x: Tensor,  # [num_tokens, H]
    w13: Tensor,  # [E, 2I, H]
    w2: Tensor,  # [E, H, I]
    weights: Tensor,  # [num_tokens, K] float32 or x's dtype
    experts: Tensor,  # [num_tokens, K] int expert ids, distinct per token
    config: MoeConfig | None = None,
) -> Tensor:  # [num_tokens, H], x's dtype
    """sum over k of weights[:, k] * silu-gated expert(x) with the Triton kernels (CUDA tensors)."""
    (num_tokens, hidden), (num_experts, two_i, _), top_k = x.shape, w13.shape, experts.shape[1]
    inter_size = two_i // 2
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, inter_size) and w2.dtype == x.dtype
    assert x.stride(1) == w13.stride(2) == w2.stride(2) == 1 and weights.shape == experts.shape
    num_assign = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg = config or moe_config(num_tokens, top_k, num_experts, x.dtype)
    ieee = x.dtype == torch.float32
    alignment = align_block_size(experts, num_experts, cfg.block_m)
    num_pid_m = alignment.block_experts.numel()
    inter = torch.empty(alignment.sorted_ids.numel(), inter_size, dtype=x.dtype, device=x.device)
    tile = {"BM": cfg.block_m, "BN": cfg.block_n, "BK": cfg.block_k, "GROUP_M": cfg.group_m, "IEEE": ieee}
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _gate_up_kernel[(num_pid_m * triton.cdiv(inter_size, cfg.block_n),)](
        x, w13, inter, *alignment, num_assign, num_pid_m, inter_size, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), TOP_K=top_k, **tile, **launch,
    )  # fmt: skip
    terms = torch.empty(num_assign, hidden, dtype=x.dtype, device=x.device)  # [N, H]
    _down_kernel[(num_pid_m * triton.cdiv(hidden, cfg.block_n),)](
        inter, w2, weights.reshape(-1), terms, *alignment, num_assign, num_pid_m, inter_size, hidden,
        w2.stride(0), w2.stride(1), **tile, **launch,
    )  # fmt: skip
    if top_k == 1:
        return terms  # row n is token n's only term
    return topk_sum(terms, experts)


def topk_sum(terms: Tensor, experts: Tensor) -> Tensor:  # [N, H], [num_tokens, K] -> [num_tokens, H]
    """Each token's K terms added in ascending expert order, in the terms' dtype."""
    num_tokens, top_k = experts.shape
    hidden = terms.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=terms.dtype, device=terms.device)
    block = min(SUM_BLOCK, triton.next_power_of_2(hidden))
    _topk_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        terms, experts.reshape(-1), out, hidden, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK=block
    )
    return out


ActAndMul = Callable[[Tensor, Tensor], Tensor]
"""(gate, up) -> act(gate) * up."""


def fused_moe_ref(
    x: Tensor,  # [num_tokens, H]
    w13: Tensor,  # [E, 2I, H]
    w2: Tensor,  # [E, H, I]
    weights: Tensor,  # [num_tokens, K] float32 or x's dtype
    experts: Tensor,  # [num_tokens, K] int64 expert ids
    act_and_mul: ActAndMul = silu_and_mul,
) -> Tensor:  # [num_tokens, H], x's dtype
    """Torch reference: the experts that got tokens, in expert order, each one's weighted output added into its
    tokens' rows (transformers' order of the sum). An expert with no tokens costs nothing.

    NOTE: reads the per-expert token counts on the host: not capturable in a CUDA graph.
    """
    out = torch.zeros_like(x)
    counts = torch.bincount(experts.flatten(), minlength=w13.shape[0]).tolist()
    for e in (e for e, n in enumerate(counts) if n):
        token, slot = torch.where(experts == e)  # [m] each: the tokens routed to e, and which choice
        gate, up = torch.nn.functional.linear(x[token], w13[e]).chunk(2, dim=-1)  # [m, I] each
        h = torch.nn.functional.linear(act_and_mul(gate, up), w2[e])  # [m, H]
        out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
    return out
