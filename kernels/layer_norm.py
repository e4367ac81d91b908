"""Fused residual add + LayerNorm in Triton, for the GPT-2 block (the LayerNorm twin of fused_ops.rms_norm).

`layer_norm(x, weight, bias, eps, residual)` returns LayerNorm(x) or, with a residual, (LayerNorm(x + residual),
x + residual) from one pass over the row, where torch takes an add and a norm kernel. The kernel runs for CUDA
tensors, `layer_norm_ref` (torch's add and F.layer_norm, as transformers' GPT-2) elsewhere.

Numerics: the sum is rounded to the activation dtype (as torch's x + residual), mean and variance are taken in
fp32 (two passes over registers, biased variance), the affine map in fp32, rounded once. torch's kernel reduces
in another order (Welford): a few fp32 ulps apart, at most about one ulp of bf16/fp16 after rounding.
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F
from torch import Tensor

from pdserve.kernels.fused_ops import MAX_ROW
from pdserve.kernels.triton_utils import check_rows, jit, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without the `gpu` extra
    triton = None  # type: ignore[assignment]


@jit
def _layer_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden], read when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    bias_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden]
    residual_out_ptr,  # [num_tokens, hidden] x + residual, written when HAS_RESIDUAL
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded as torch's x + residual
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    mean = tl.sum(x32, axis=0) / hidden
    centered = tl.where(mask, x32 - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(centered * centered, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = centered * rstd * w + b
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@overload
def layer_norm_triton(x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: None = None) -> Tensor: ...
@overload
def layer_norm_triton(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: Tensor
) -> tuple[Tensor, Tensor]: ...
def layer_norm_triton(
    x: Tensor,  # [num_tokens, hidden]
    weight: Tensor,  # [hidden], x's dtype
    bias: Tensor,  # [hidden], x's dtype
    eps: float,
    residual: Tensor | None = None,  # [num_tokens, hidden], x's dtype
) -> Tensor | tuple[Tensor, Tensor]:
    """LayerNorm(x) in one pass; with residual, (LayerNorm(x + residual), x + residual) in one pass."""
    assert x.dim() == 2, f"x must be [num_tokens, hidden], got {tuple(x.shape)}"
    num_tokens, hidden = x.shape
    check_rows("x", x, x.shape, x.dtype)
    check_rows("weight", weight, torch.Size([hidden]), x.dtype)
    check_rows("bias", bias, torch.Size([hidden]), x.dtype)
    block = triton.next_power_of_2(hidden)
    assert block <= MAX_ROW, f"hidden {hidden} exceeds the widest row {MAX_ROW}"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = out
    if residual is not None:
        check_rows("residual", residual, x.shape, x.dtype)
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        res = x if residual is None else residual  # unread without a residual
        _layer_norm_kernel[(num_tokens,)](
            x, res, weight, bias, out, residual_out, hidden, eps,
            x.stride(0), res.stride(0), out.stride(0), residual_out.stride(0),
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return out if residual is None else (out, residual_out)


@overload
def layer_norm_ref(x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: None = None) -> Tensor: ...
@overload
def layer_norm_ref(x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: Tensor) -> tuple[Tensor, Tensor]: ...
def layer_norm_ref(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """Torch reference: transformers' GPT-2 order (residual add, then nn.LayerNorm)."""
    if residual is None:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps), x


@overload
def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: None = None) -> Tensor: ...
@overload
def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: Tensor) -> tuple[Tensor, Tensor]: ...
def layer_norm(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """LayerNorm of x [num_tokens, hidden] (after adding residual, returned too): Triton on CUDA, torch elsewhere."""
    if use_triton(x):
        return layer_norm_triton(x, weight, bias, eps, residual)
    return layer_norm_ref(x, weight, bias, eps, residual)
