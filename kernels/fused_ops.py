"""Fused elementwise ops of the Llama block in Triton: RMSNorm (with the residual add) and SiLU-and-mul.

Each op comes three ways: `<op>_triton` launches the kernel, `<op>_ref` is the torch code the model ran before
(transformers' op order, so fp32 on CPU matches transformers bit for bit), and `<op>` picks the kernel for CUDA
tensors and the reference otherwise. Layouts: rows are tokens, the last dimension is contiguous, other strides
are free (views of a fused projection are fine); outputs are new contiguous tensors unless given.

Numerics follow torch's rounding step by step: math in fp32, rounded to the activation dtype wherever the torch
code holds a value in that dtype (the residual sum, the normalized row before the weight, SiLU before the
multiply). What differs is the order of the RMSNorm reduction and the rsqrt/exp approximations: a few fp32 ulps,
at most about one ulp of bf16/fp16 after rounding. Rope is applied inside the attention backend's kernels
(kernels/rope_tiles.py).

triton is optional (the `gpu` extra). Without it this module still imports and every op runs its torch
reference; the kernels are only compiled on first launch.
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F
from torch import Tensor

from pdserve.kernels.triton_utils import check_rows, jit, pdl_wait, use_pdl, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without the `gpu` extra
    triton = None  # type: ignore[assignment]

MAX_ROW = 32768
"""Widest RMSNorm row: one program holds the whole row in registers."""
SILU_BLOCK = 1024
"""Elements per SiLU-and-mul program."""


# ---------------------------------------------------------------------------------------------- RMSNorm


@jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden], read when HAS_RESIDUAL
    weight_ptr,  # [hidden]
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
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded as torch's x + residual
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.math.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty)  # cast before the weight, as torch
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@overload
def rms_norm_triton(
    x: Tensor, weight: Tensor, eps: float, residual: None = None, *, out: Tensor | None = None, pdl: bool = False
) -> Tensor: ...
@overload
def rms_norm_triton(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor,
    *,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
    pdl: bool = False,
) -> tuple[Tensor, Tensor]: ...
def rms_norm_triton(
    x: Tensor,  # [num_tokens, hidden]
    weight: Tensor,  # [hidden]
    eps: float,
    residual: Tensor | None = None,  # [num_tokens, hidden], x's dtype
    *,
    out: Tensor | None = None,  # [num_tokens, hidden], written in place
    residual_out: Tensor | None = None,  # [num_tokens, hidden], written in place
    pdl: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """rms_norm(x) in one pass; with residual, (rms_norm(x + residual), x + residual) in one pass.

    The output dtype is torch's for `weight * normed`: x's dtype when the weight's matches. With pdl
    (triton_utils.use_pdl), a programmatic dependent launch.
    """
    assert x.dim() == 2, f"x must be [num_tokens, hidden], got {tuple(x.shape)}"
    num_tokens, hidden = x.shape
    check_rows("x", x, x.shape, x.dtype)
    check_rows("weight", weight, torch.Size([hidden]), weight.dtype)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device) if out is None else out
    check_rows("out", out, x.shape, out_dtype)
    if residual is None:
        _launch_rms_norm(x, x, weight, out, out, eps, has_residual=False, pdl=pdl)  # x, out stand in for the residuals
        return out
    check_rows("residual", residual, x.shape, x.dtype)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual_out is None else residual_out
    check_rows("residual_out", residual_out, x.shape, x.dtype)
    _launch_rms_norm(x, residual, weight, out, residual_out, eps, has_residual=True, pdl=pdl)
    return out, residual_out


def _launch_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    out: Tensor,
    residual_out: Tensor,
    eps: float,
    has_residual: bool,
    pdl: bool,
) -> None:
    num_tokens, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    assert block <= MAX_ROW, f"hidden {hidden} exceeds the widest row {MAX_ROW}"
    if num_tokens == 0:
        return
    _rms_norm_kernel[(num_tokens,)](
        x, residual, weight, out, residual_out, hidden, eps,
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
        BLOCK=block,
        HAS_RESIDUAL=has_residual,
        PDL=pdl,
        num_warps=min(16, max(1, block // 256)),
        launch_pdl=pdl,
    )  # fmt: skip


@overload
def rms_norm_ref(x: Tensor, weight: Tensor, eps: float, residual: None = None) -> Tensor: ...
@overload
def rms_norm_ref(x: Tensor, weight: Tensor, eps: float, residual: Tensor) -> tuple[Tensor, Tensor]: ...
def rms_norm_ref(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """Torch reference: transformers' LlamaRMSNorm (normalize in fp32, cast, then scale) after the residual add."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(dtype)
    return out if residual is None else (out, x)


@overload
def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: None = None) -> Tensor: ...
@overload
def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor) -> tuple[Tensor, Tensor]: ...
def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """rms_norm(x), or (rms_norm(x + residual), x + residual): the Triton kernel on CUDA (a programmatic dependent
    launch where use_pdl), torch elsewhere."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual, pdl=use_pdl(x))
    return rms_norm_ref(x, weight, eps, residual)


# ---------------------------------------------------------------------------------------------- SiLU and mul


@jit
def _silu_and_mul_kernel(
    gate_ptr,  # [num_tokens, inter]
    up_ptr,  # [num_tokens, inter]
    out_ptr,  # [num_tokens, inter]
    inter,
    stride_g,
    stride_u,
    stride_o,
    BLOCK: tl.constexpr,
    HALF: tl.constexpr,  # 0: gate and up apart; else blocks of HALF columns, gate then up (silu_and_mul_blocks)
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    cols = offs if HALF == 0 else (offs // HALF) * (2 * HALF) + offs % HALF
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # F.silu: fp32 math, rounded once to the dtype
    tl.store(out_ptr + row * stride_o + offs, (act * u).to(dtype), mask=mask)


def silu_and_mul_triton(
    gate: Tensor,  # [num_tokens, inter]
    up: Tensor,  # [num_tokens, inter]
    out: Tensor | None = None,  # [num_tokens, inter], written in place
) -> Tensor:  # [num_tokens, inter], gate's dtype
    """silu(gate) * up in one pass."""
    assert gate.dim() == 2, f"gate must be [num_tokens, inter], got {tuple(gate.shape)}"
    num_tokens, inter = gate.shape
    check_rows("gate", gate, gate.shape, gate.dtype)
    check_rows("up", up, gate.shape, gate.dtype)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if out is None else out
    check_rows("out", out, gate.shape, gate.dtype)
    return _launch_silu_and_mul(gate, up, out, half=0)


def _launch_silu_and_mul(gate: Tensor, up: Tensor, out: Tensor, half: int) -> Tensor:  # out: [num_tokens, inter]
    num_tokens, inter = out.shape
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    if num_tokens > 0:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            gate, up, out, inter, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block, HALF=half, num_warps=4
        )
    return out


def silu_and_mul_blocks_triton(
    gate_up: Tensor,  # [num_tokens, 2 * inter]: blocks of `half` gate columns, each followed by its up columns
    half: int,
    out: Tensor | None = None,  # [num_tokens, inter], written in place
) -> Tensor:  # [num_tokens, inter], gate_up's dtype
    """silu(gate) * up of a GEMM over an interleaved gate/up weight (kernels/swiglu_gemm.py): output column
    j * half + c comes from gate column 2 * j * half + c and up column (2 * j + 1) * half + c."""
    num_tokens, two_inter = gate_up.shape
    inter = two_inter // 2
    assert two_inter % (2 * half) == 0 and half & (half - 1) == 0, f"width {two_inter}, half {half}"
    check_rows("gate_up", gate_up, gate_up.shape, gate_up.dtype)
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    check_rows("out", out, torch.Size((num_tokens, inter)), gate_up.dtype)
    return _launch_silu_and_mul(gate_up, gate_up[:, half:], out, half)


def silu_and_mul_blocks_ref(gate_up: Tensor, half: int) -> Tensor:  # [n, 2 * inter] -> [n, inter]
    """Torch reference of silu_and_mul_blocks_triton."""
    blocks = gate_up.view(gate_up.shape[0], -1, 2, half)  # [n, blocks, gate | up, half]
    return silu_and_mul_ref(blocks[:, :, 0], blocks[:, :, 1]).reshape(gate_up.shape[0], -1)


def silu_and_mul_blocks(gate_up: Tensor, half: int) -> Tensor:
    """silu(gate) * up over interleaved gate/up blocks: the Triton kernel on CUDA, torch elsewhere."""
    return silu_and_mul_blocks_triton(gate_up, half) if use_triton(gate_up) else silu_and_mul_blocks_ref(gate_up, half)


def silu_and_mul_ref(gate: Tensor, up: Tensor) -> Tensor:
    """Torch reference: SwiGLU's act(gate) * up with transformers' SiLU (F.silu)."""
    return F.silu(gate) * up


def silu_and_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up: the Triton kernel on CUDA, torch elsewhere."""
    return silu_and_mul_triton(gate, up) if use_triton(gate) else silu_and_mul_ref(gate, up)
