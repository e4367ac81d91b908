"""Fused elementwise ops of the Llama block in Triton: RMSNorm (with the residual add), SiLU-and-mul, rope.

Each op comes three ways: `<op>_triton` launches the kernel, `<op>_ref` is the torch code the model ran before
(transformers' op order, so fp32 on CPU matches transformers bit for bit), and `<op>` picks the kernel for CUDA
tensors and the reference otherwise. Layouts: rows are tokens, the last dimension is contiguous, other strides
are free (views of a fused projection are fine); outputs are new contiguous tensors unless given.

Numerics follow torch's rounding step by step: math in fp32, rounded to the activation dtype wherever the torch
code holds a value in that dtype (the residual sum, the normalized row before the weight, SiLU before the
multiply, each rope product and their sum). What differs is the order of the RMSNorm reduction and the
rsqrt/exp approximations: a few fp32 ulps, at most about one ulp of bf16/fp16 after rounding. Rope is launched
without FMA contraction and matches torch exactly.

NOTE: triton is optional (the `gpu` extra). Without it this module still imports and every op runs its torch
reference; the kernels are only compiled on first launch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without the `gpu` extra
    triton = None  # type: ignore[assignment]

MAX_ROW = 32768
"""Widest RMSNorm row: one program holds the whole row in registers."""
SILU_BLOCK = 1024
"""Elements per SiLU-and-mul program."""


def _jit(fn: Callable[..., None]) -> Any:
    return fn if triton is None else triton.jit(fn)


def _use_triton(x: Tensor) -> bool:
    return x.is_cuda and triton is not None


# ---------------------------------------------------------------------------------------------- RMSNorm


@_jit
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
    mean_sq = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.math.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty)  # cast before the weight, as torch
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(name: str, t: Tensor, shape: torch.Size, dtype: torch.dtype) -> None:
    assert t.shape == shape, f"{name} must be {tuple(shape)}, got {tuple(t.shape)}"
    assert t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}"
    assert t.stride(-1) == 1, f"{name}: the last dimension must be contiguous"


@overload
def rms_norm_triton(
    x: Tensor, weight: Tensor, eps: float, residual: None = None, *, out: Tensor | None = None
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
) -> tuple[Tensor, Tensor]: ...
def rms_norm_triton(
    x: Tensor,  # [num_tokens, hidden]
    weight: Tensor,  # [hidden]
    eps: float,
    residual: Tensor | None = None,  # [num_tokens, hidden], x's dtype
    *,
    out: Tensor | None = None,  # [num_tokens, hidden], written in place
    residual_out: Tensor | None = None,  # [num_tokens, hidden], written in place
) -> Tensor | tuple[Tensor, Tensor]:
    """rms_norm(x) in one pass; with residual, (rms_norm(x + residual), x + residual) in one pass.

    The output dtype is torch's for `weight * normed`: x's dtype when the weight's matches.
    """
    assert x.dim() == 2, f"x must be [num_tokens, hidden], got {tuple(x.shape)}"
    num_tokens, hidden = x.shape
    _check_rows("x", x, x.shape, x.dtype)
    _check_rows("weight", weight, torch.Size([hidden]), weight.dtype)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device) if out is None else out
    _check_rows("out", out, x.shape, out_dtype)
    if residual is None:
        _launch_rms_norm(x, x, weight, out, out, eps, has_residual=False)  # x, out stand in for the residuals
        return out
    _check_rows("residual", residual, x.shape, x.dtype)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual_out is None else residual_out
    _check_rows("residual_out", residual_out, x.shape, x.dtype)
    _launch_rms_norm(x, residual, weight, out, residual_out, eps, has_residual=True)
    return out, residual_out


def _launch_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, out: Tensor, residual_out: Tensor, eps: float, has_residual: bool
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
        num_warps=min(16, max(1, block // 256)),
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
    """rms_norm(x), or (rms_norm(x + residual), x + residual): the Triton kernel on CUDA, torch elsewhere."""
    if _use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


# ---------------------------------------------------------------------------------------------- SiLU and mul


@_jit
def _silu_and_mul_kernel(
    gate_ptr,  # [num_tokens, inter]
    up_ptr,  # [num_tokens, inter]
    out_ptr,  # [num_tokens, inter]
    inter,
    stride_g,
    stride_u,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
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
    _check_rows("gate", gate, gate.shape, gate.dtype)
    _check_rows("up", up, gate.shape, gate.dtype)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if out is None else out
    _check_rows("out", out, gate.shape, gate.dtype)
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    if num_tokens > 0:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            gate, up, out, inter, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out


def silu_and_mul_ref(gate: Tensor, up: Tensor) -> Tensor:
    """Torch reference: SwiGLU's act(gate) * up with transformers' SiLU (F.silu)."""
    return F.silu(gate) * up


def silu_and_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up: the Triton kernel on CUDA, torch elsewhere."""
    return silu_and_mul_triton(gate, up) if _use_triton(gate) else silu_and_mul_ref(gate, up)


# ---------------------------------------------------------------------------------------------- rope


@_jit
def _rope_heads(
    x_ptr,  # [num_tokens, num_heads, head_dim] at one token's row
    out_ptr,
    num_heads,
    stride_xh,
    stride_oh,
    cos1,  # [1, HALF_PAD] fp32, rounded to the dtype: cos of the first half
    cos2,
    sin1,
    sin2,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HALF_PAD)[None, :]
    mask = (offs_h < num_heads) & (offs_d < HALF)
    src = x_ptr + offs_h * stride_xh + offs_d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF_PAD]
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # NOTE: each product and the sum round to the dtype, as torch's x * cos + rotate_half(x) * sin does
    out1 = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    dst = out_ptr + offs_h * stride_oh + offs_d
    tl.store(dst, out1.to(dtype), mask=mask)
    tl.store(dst + HALF, out2.to(dtype), mask=mask)


@_jit
def _rope_kernel(
    positions_ptr,  # [num_tokens] int64 | int32
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_ptr,  # [max_positions, head_dim] fp32 | q's dtype
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    num_heads,
    num_kv_heads,
    max_positions,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_sin,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # NOTE: a position outside the table is clamped, so no read leaves it (torch would raise instead)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_positions - 1)
    offs_d = tl.arange(0, HALF_PAD)[None, :]
    d_mask = offs_d < HALF
    dtype = q_out_ptr.dtype.element_ty
    cos_row = cos_ptr + pos * stride_cos + offs_d
    sin_row = sin_ptr + pos * stride_sin + offs_d
    # the tables are cast to the dtype first, as RotaryEmbedding does; [1, HALF_PAD] each
    cos1 = tl.load(cos_row, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_row + HALF, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_row, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_row + HALF, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    _rope_heads(
        q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, num_heads, stride_qh, stride_qoh,
        cos1, cos2, sin1, sin2, HEADS_PAD, HALF, HALF_PAD,
    )  # fmt: skip
    _rope_heads(
        k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, num_kv_heads, stride_kh, stride_koh,
        cos1, cos2, sin1, sin2, KV_HEADS_PAD, HALF, HALF_PAD,
    )  # fmt: skip


def _check_rope_inputs(positions: Tensor, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    assert q.dim() == 3 and k.dim() == 3, "q and k must be [num_tokens, heads, head_dim]"
    num_tokens, _, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, f"k {tuple(k.shape)} does not match q {q.shape}"
    assert head_dim % 2 == 0, f"head_dim must be even, got {head_dim}"
    assert q.dtype == k.dtype, f"dtype mismatch: q {q.dtype}, k {k.dtype}"
    assert q.stride(2) == 1 and k.stride(2) == 1, "head_dim must be the contiguous dimension of q and k"
    assert positions.shape == (num_tokens,), f"positions must be [{num_tokens}], got {tuple(positions.shape)}"
    assert positions.is_contiguous(), "positions must be contiguous"
    assert positions.dtype in (torch.int64, torch.int32), f"positions must be int64 or int32, got {positions.dtype}"
    for name, table in (("cos", cos), ("sin", sin)):
        assert table.dim() == 2 and table.shape[1] == head_dim, f"{name} must be [max_positions, {head_dim}]"
        assert table.dtype in (torch.float32, q.dtype), f"{name} must be float32 or {q.dtype}, got {table.dtype}"
        assert table.stride(1) == 1, f"{name} rows must be contiguous"
    assert cos.shape == sin.shape, "cos and sin tables differ in shape"


def apply_rope_triton(
    positions: Tensor,  # [num_tokens] int64 | int32
    q: Tensor,  # [num_tokens, num_heads, head_dim]
    k: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: Tensor,  # [max_positions, head_dim] fp32, or q's dtype (a model cast whole: the same values once cast)
    sin: Tensor,  # [max_positions, head_dim] like cos
    q_out: Tensor | None = None,  # [num_tokens, num_heads, head_dim], written in place
    k_out: Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim], written in place
) -> tuple[Tensor, Tensor]:
    """Rotate-half rope of q and k at `positions`, one program per token over all its q and k heads.

    Positions outside the tables are clamped to them on the device (nothing is read out of bounds).
    """
    _check_rope_inputs(positions, q, k, cos, sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    _check_rows("q_out", q_out, q.shape, q.dtype)
    _check_rows("k_out", k_out, k.shape, k.dtype)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens > 0:
        _rope_kernel[(num_tokens,)](
            positions, q, k, cos, sin, q_out, k_out, num_heads, num_kv_heads, cos.shape[0],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos.stride(0), sin.stride(0),
            HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HALF=head_dim // 2,
            HALF_PAD=triton.next_power_of_2(head_dim // 2),
            num_warps=4,
            enable_fp_fusion=False,  # NOTE: no FMA: products and sum round separately, as in torch
        )  # fmt: skip
    return q_out, k_out


def apply_rope_ref(positions: Tensor, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Torch reference: transformers' rotate-half rope with the tables cast to q's dtype first."""
    cos = cos[positions].to(q.dtype)[:, None, :]  # [num_tokens, 1, head_dim]
    sin = sin[positions].to(q.dtype)[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(positions: Tensor, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate-half rope of q [num_tokens, heads, head_dim] and k: the Triton kernel on CUDA, torch elsewhere."""
    if _use_triton(q):
        return apply_rope_triton(positions, q, k, cos, sin)
    return apply_rope_ref(positions, q, k, cos, sin)
