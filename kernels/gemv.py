"""One-row GEMMs, the projections of a decode step at batch 1 (Triton): y = x @ W^T for x of one row, each
program streaming BLOCK_N whole rows of W (no split-K, so no second reduce launch), optionally with SwiGLU on the
way in: the down projection reads the gate/up GEMM's interleaved output and applies silu(gate) * up itself, so the
step has no SiLU-and-mul launch.

At one row a projection is a read of W. cuBLAS streams the halved matrices of TP 2 at 2.5-3.4 TB/s on an H200 and
adds a split-K reduce launch to two of the four (docs/benchmarks.md, Tensor parallelism).

Numerics: fp32 products summed in a fixed order (per lane along K, then a tree), rounded once to the dtype; the
SwiGLU input rounded as kernels/fused_ops.py's SiLU-and-mul rounds it (SiLU, then the product).

NOTE: triton is optional (the `gpu` extra): without it this module imports and nothing here can launch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from pdserve.kernels.allreduce_norm import SENTINEL_BITS, SLOTS, PeerRows
from pdserve.kernels.triton_utils import jit, pdl_wait

try:
    import triton
    import triton.language as tl

    from pdserve.kernels.allreduce_norm import SENTINEL_INT, _buffer, _without_sentinel
except ImportError:  # pragma: no cover - CPU installs without the `gpu` extra
    triton = None  # type: ignore[assignment]


class GemvConfig(NamedTuple):
    """One launch's tiling: BLOCK_N rows of W per program, BLOCK_K columns per loop step."""

    block_n: int
    block_k: int
    num_warps: int


def tiling(k: int) -> GemvConfig | None:
    """The tiling of a projection with K columns: 4 rows a program, loop steps of up to 1024 columns; None where K
    is not a multiple of 16. On an H200 it is within 4.3% of the best of 46 tilings on every projection of the 8B
    shape at TP 1 and 2 (bench/results/gemv_h200_2026-11-27/sweep.json)."""
    block_k = min(1024, k & -k)
    return GemvConfig(4, block_k, 4) if block_k >= 16 else None


@jit
def _x_chunk(x_ptr, cols, HALF: tl.constexpr):
    """x[cols] in fp32; with HALF, silu(gate) * up of an interleaved gate/up row (blocks of HALF gate columns,
    each followed by its HALF up columns), rounded as the SiLU-and-mul kernel rounds."""
    if HALF == 0:
        chunk = tl.load(x_ptr + cols).to(tl.float32)
    else:
        src = (cols // HALF) * (2 * HALF) + cols % HALF
        g = tl.load(x_ptr + src).to(tl.float32)
        u = tl.load(x_ptr + src + HALF).to(tl.float32)
        dtype = x_ptr.dtype.element_ty
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        chunk = (act * u).to(dtype).to(tl.float32)
    return chunk


@jit
def _gemv_kernel(
    x_ptr,  # [K], or [2 * K] interleaved gate/up with HALF
    w_ptr,  # [N, K], rows stride_w apart
    bias_ptr,  # [N], read with HAS_BIAS
    y_ptr,  # [N]
    K,
    stride_w,
    buffer_ptrs,  # PUSH: [WORLD] int64, every rank's fused-sum buffer [SLOTS, WORLD, capacity, N]
    epochs_ptr,  # PUSH: [PROGRAMS] int32 of the fused sum
    capacity,
    HALF: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PUSH: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    SLOTS: tl.constexpr,
    INT: tl.constexpr,
    SENTINEL: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    first = 0
    if PDL:  # NOTE: launched early beside the kernel before it (programmatic dependent launch): no kernel writes W,
        # so the first tile is read before waiting for that kernel's writes (x)
        cols = tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + cols[None, :])
        pdl_wait(PDL)
        acc += w.to(tl.float32) * _x_chunk(x_ptr, cols, HALF)[None, :]
        first = BLOCK_K
    for k in range(first, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + cols[None, :])  # [BLOCK_N, BLOCK_K]
        acc += w.to(tl.float32) * _x_chunk(x_ptr, cols, HALF)[None, :]
    dtype = y_ptr.dtype.element_ty
    total = tl.sum(acc, axis=1)
    if HAS_BIAS:
        total += tl.load(bias_ptr + rows).to(tl.float32)
    y = total.to(dtype)
    if PUSH:  # NOTE: kernels/allreduce_norm.py's step 1 for this row, as each program's part of it is done
        y = _without_sentinel(y, INT, SENTINEL)
        region = tl.cast(capacity, tl.int64) * tl.num_programs(0) * BLOCK_N
        slot = (tl.load(epochs_ptr) % SLOTS) * WORLD * region
        for q in tl.static_range(WORLD):
            if q != RANK:
                tl.store(_buffer(buffer_ptrs, q, dtype) + slot + RANK * region + rows, y)
    tl.store(y_ptr + rows, y)


def gemv_fits(x: Tensor, weight: Tensor, half: int = 0) -> bool:
    """Whether gemv takes x @ weight^T (with half: of x's SwiGLU): one row on CUDA, whole tiles (tiling), rows
    contiguous. NOTE: every projection of every eager pass asks, so the cheap, selective checks come first."""
    if x.dim() != 2 or x.shape[0] != 1 or triton is None or not x.is_cuda:
        return False
    n, k = weight.shape
    config = tiling(k)
    return (
        config is not None
        and x.shape[1] == (2 * k if half else k)
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.stride(1) == 1
        and x.is_contiguous()
        and n % config.block_n == 0
    )


def gemv(
    x: Tensor,  # [1, K], or [1, 2 * K] interleaved gate/up with half
    weight: Tensor,  # [N, K]
    half: int = 0,
    config: GemvConfig | None = None,
    bias: Tensor | None = None,  # [N]
    push: PeerRows | None = None,
    pdl: bool = False,
) -> Tensor:  # [1, N], x's dtype
    """x @ weight^T (+ bias; with half: silu(gate) * up of x first, kernels/swiglu_gemm.py's layout) at `config`
    (default: tiling(K)); the caller checks gemv_fits. With push, the row also goes into every peer's buffer of
    the fused sum that follows (kernels/allreduce_norm.py, called with pushed=True next). With pdl
    (triton_utils.use_pdl), a programmatic dependent launch: the first weight tile is read while the kernel before
    it finishes."""
    n, k = weight.shape
    config = config or tiling(k)
    assert config is not None, f"no tiling for K = {k}"
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    bits = x.element_size() * 8
    target = push or PeerRows(y, y, 0, 0)  # NOTE: unused without PUSH; any tensors stand in
    _gemv_kernel[(n // config.block_n,)](
        x, weight, y if bias is None else bias, y, k, weight.stride(0), target.buffer_ptrs, target.epochs,
        target.capacity, HALF=half, HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        PUSH=push is not None, RANK=target.rank, WORLD=target.buffer_ptrs.numel() if push else 1, SLOTS=SLOTS,
        INT=SENTINEL_INT[bits],
        SENTINEL=SENTINEL_BITS[bits], PDL=pdl, num_warps=config.num_warps,
        num_stages=1,  # NOTE: 3 timed the same (sweep_bk1024.json)
        launch_pdl=pdl,
    )  # fmt: skip
    return y


def gemv_ref(x: Tensor, weight: Tensor, half: int = 0, bias: Tensor | None = None) -> Tensor:  # -> [1, N]
    """Torch reference of gemv (fp32 math, one rounding; the SwiGLU input rounded as the kernel rounds it)."""
    if half:
        from pdserve.kernels.fused_ops import silu_and_mul_blocks_ref

        x = silu_and_mul_blocks_ref(x, half)
    y = x.float() @ weight.float().t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
