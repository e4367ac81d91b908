"""Rotate-half rope applied where q and k are loaded, so no kernel of its own writes them rotated.

The attention kernels rotate each query tile as they load it (a query's position is implied by its sequence:
the last query_len of its seq_len tokens) and the KV append rotates each new key on its way into the cache. The
arithmetic is transformers' (`x * cos + rotate_half(x) * sin` with the tables cast to x's dtype first): each
product rounds to the dtype, then their sum does, so 16-bit results match torch's bit for bit.

triton is optional here (the reference runs without it). In fp32 the compiler may contract a product and
the sum into one FMA where FP fusion is on (the attention kernels; the KV append turns it off, so the cache holds
exactly torch's K): one rounding fewer than torch, an ulp that the attention's own summation order dwarfs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.kernels.triton_utils import jit

try:
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without the `gpu` extra: the torch reference only
    tl = None


class RopeTables(NamedTuple):
    """A model's rope tables, built as transformers builds them (attention scaling included)."""

    cos: torch.Tensor  # [max_positions, head_dim] fp32, or the model's dtype
    sin: torch.Tensor


def check_tables(tables: RopeTables, head_dim: int, dtype: torch.dtype) -> None:
    for name, t in zip(("cos", "sin"), tables, strict=True):
        assert t.dim() == 2 and t.shape[1] == head_dim, f"rope {name} must be [max_positions, {head_dim}]"
        assert t.dtype in (torch.float32, dtype), f"rope {name} must be float32 or {dtype}, got {t.dtype}"
        assert t.stride(1) == 1, f"rope {name}: rows must be contiguous"
    assert tables.cos.shape == tables.sin.shape and tables.cos.stride() == tables.sin.stride(), "cos and sin differ"
    assert head_dim % 2 == 0, f"rope needs an even head_dim, got {head_dim}"


def rope_ref_one(
    positions: torch.Tensor,  # [num_tokens]
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    tables: RopeTables,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """Torch reference: transformers' rotate-half rope, the tables cast to x's dtype first."""
    cos = tables.cos[positions].to(x.dtype)[:, None, :]  # [num_tokens, 1, head_dim]
    sin = tables.sin[positions].to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@jit
def load_rotated(
    row_ptrs,  # [ROWS] pointers to element 0 of each row (a head of a token)
    row_mask,  # [ROWS] rows to load; the others come back zero
    pos,  # [ROWS] each row's position (clamped to the tables, so no read leaves them)
    cos_ptr,  # [max_positions, head_dim]
    sin_ptr,
    stride_cos,  # row stride of both tables
    max_positions,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two
):
    """[ROWS, D_PAD] rows in their own dtype, rope applied; columns past HEAD_DIM are zero."""
    offs_d = tl.arange(0, D_PAD)[None, :]
    first = offs_d < HEAD_DIM // 2
    mask = row_mask[:, None] & (offs_d < HEAD_DIM)
    partner = tl.where(first, offs_d + HEAD_DIM // 2, offs_d - HEAD_DIM // 2)  # rotate_half's source column
    x = tl.load(row_ptrs[:, None] + offs_d, mask=mask, other=0.0)
    swapped = tl.load(row_ptrs[:, None] + partner, mask=mask, other=0.0)
    dtype = x.dtype
    p = tl.minimum(tl.maximum(pos, 0), max_positions - 1).to(tl.int64)[:, None] * stride_cos
    cos = tl.load(cos_ptr + p + offs_d, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + p + offs_d, mask=mask, other=0.0).to(dtype).to(tl.float32)
    swapped = swapped.to(tl.float32)
    rotated = tl.where(first, -swapped, swapped)
    out = (x.to(tl.float32) * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)
    return out.to(dtype)
