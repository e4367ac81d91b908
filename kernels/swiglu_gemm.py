"""The MLP's gate/up projection with SwiGLU in the GEMM's epilogue (Triton, TMA): silu(x @ Wg^T) * (x @ Wu^T) in
one persistent kernel, so a long prefill pass never writes the [tokens, 2 * intermediate] gate/up output and
reads it back (the SiLU-and-mul kernel's 196 MB a layer at 4000 tokens on the 1B Llama shape).

Layout: the merged gate/up weight [2I, K] ([gate; up], MergedLinear's order) is stored interleaved in blocks of
SWIGLU_BLOCK rows, [g_0, u_0, g_1, u_1, ...] (interleave_gate_up), so one accumulator tile of 2 * SWIGLU_BLOCK
columns holds gate block j and up block j, and its epilogue writes output columns of block j. Any GEMM over the
interleaved weight gives the gate/up output in the same blocks: short passes (decode, few tokens), where cuBLAS is
faster, run it and then SiLU-and-mul over the blocks (kernels.fused_ops.silu_and_mul_blocks).

Numerics are the unfused path's: fp32 accumulation, gate and up rounded to the dtype (as a GEMM's output is),
SiLU in fp32 rounded once, the product rounded; only the GEMM's summation order may differ from cuBLAS's (a few
fp32 ulps before rounding).

16-bit types on Hopper-class GPUs only (TMA descriptors made on the device: scratch from torch's caching
allocator, kernels.triton_utils.set_triton_allocator); the grid depends on the token count only, so a CUDA
graph captures it like any launch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdserve.kernels.triton_utils import device_num_sms, set_triton_allocator

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without the `gpu` extra
    triton = None  # type: ignore[assignment]

SWIGLU_BLOCK = 128
"""Rows of gate (then of up) per interleaved block: half the fused kernel's accumulator width."""
FUSED_MIN_TOKENS = 1024
"""Passes of fewer tokens keep cuBLAS + SiLU-and-mul (the persistent kernel's 128-row tiles waste work there)."""
_BM, _BK, _STAGES, _WARPS = 128, 64, 3, 8
_GROUP_M = 64
"""Row tiles per tile group: every row tile of a pass up to 8192 tokens, so the programs sweep the weight's column
tiles once each while the pass's activations stay in L2."""


def interleave_gate_up(weight: Tensor, block: int = SWIGLU_BLOCK) -> Tensor:  # [2I, K] -> [2I, K]
    """[gate; up] rows -> [g_0, u_0, g_1, u_1, ...] in blocks of `block` rows (a new tensor)."""
    two_i, k = weight.shape
    assert two_i % (2 * block) == 0, f"gate/up rows {two_i} not a multiple of 2 * {block}"
    return weight.view(2, two_i // (2 * block), block, k).transpose(0, 1).reshape(two_i, k)


def deinterleave_gate_up(weight: Tensor, block: int = SWIGLU_BLOCK) -> Tensor:  # [2I, K] -> [2I, K]
    """The inverse of interleave_gate_up."""
    two_i, k = weight.shape
    return weight.view(two_i // (2 * block), 2, block, k).transpose(0, 1).reshape(two_i, k)


def fused_swiglu_supported(weight: Tensor, bias: Tensor | None) -> bool:
    """Whether a gate/up weight can take the fused path: CUDA on sm_90+, 16-bit, no bias, whole blocks, TMA-aligned."""
    if triton is None or not weight.is_cuda or bias is not None or weight.dtype == torch.float32:
        return False
    if torch.cuda.get_device_capability(weight.device)[0] < 9:
        return False
    two_i, k = weight.shape
    return two_i % (2 * SWIGLU_BLOCK) == 0 and k % 8 == 0


if triton is not None:

    @triton.jit
    def _tile(tile, num_pid_in_group, num_pid_m, GROUP_M: tl.constexpr):
        """(row tile, column tile) of a linear tile index, grouped along rows for L2 reuse of the weight."""
        group = tile // num_pid_in_group
        first_m = group * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        return first_m + (tile % size_m), (tile % num_pid_in_group) // size_m

    @triton.jit(do_not_specialize=["num_tokens"])
    def _swiglu_gemm_kernel(
        x_ptr,  # [num_tokens, K], rows contiguous
        w_ptr,  # [N, K] = [2I, K], interleaved (interleave_gate_up)
        out_ptr,  # [num_tokens, I]
        num_tokens,
        N,
        K,
        NUM_SMS: tl.constexpr,  # the grid's stride over tiles (the grid is smaller when there are fewer tiles)
        BM: tl.constexpr,
        BN: tl.constexpr,  # 2 * SWIGLU_BLOCK
        BK: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        dtype = out_ptr.dtype.element_ty
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[num_tokens, K], strides=[K, 1], block_shape=[BM, BK])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
        o_desc = tl.make_tensor_descriptor(
            out_ptr, shape=[num_tokens, N // 2], strides=[N // 2, 1], block_shape=[BM, BN // 2]
        )
        num_pid_m = tl.cdiv(num_tokens, BM)
        num_tiles = num_pid_m * tl.cdiv(N, BN)
        num_pid_in_group = GROUP_M * tl.cdiv(N, BN)
        k_tiles = tl.cdiv(K, BK)
        tile_out = tl.program_id(0) - NUM_SMS  # the epilogue's own tile counter keeps the K loop's
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS):  # software pipelining across tiles intact
            pm, pn = _tile(tile, num_pid_in_group, num_pid_m, GROUP_M)
            acc = tl.zeros((BM, BN), dtype=tl.float32)  # [BM, gate block | up block]
            for ki in range(k_tiles):
                a = x_desc.load([pm * BM, ki * BK])  # [BM, BK]
                b = w_desc.load([pn * BN, ki * BK])  # [BN, BK]
                acc = tl.dot(a, b.T, acc)
            tile_out += NUM_SMS
            pm, pn = _tile(tile_out, num_pid_in_group, num_pid_m, GROUP_M)
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))  # [BM, BN // 2] each
            g = gate.to(dtype).to(tl.float32)
            u = up.to(dtype).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # F.silu: fp32 math, rounded once
            o_desc.store([pm * BM, pn * (BN // 2)], (act * u).to(dtype))


def swiglu_gemm(
    x: Tensor,  # [num_tokens, K]
    weight: Tensor,  # [2I, K], interleaved
    out: Tensor | None = None,  # [num_tokens, I]
) -> Tensor:  # [num_tokens, I], x's dtype
    """silu(x @ gate^T) * (x @ up^T) for an interleaved gate/up weight (fused_swiglu_supported must hold)."""
    num_tokens, k = x.shape
    two_i = weight.shape[0]
    assert weight.shape == (two_i, k) and weight.dtype == x.dtype and weight.is_contiguous()
    assert x.stride(1) == 1 and x.stride(0) == k, "x: rows must be contiguous"
    out = torch.empty(num_tokens, two_i // 2, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (num_tokens, two_i // 2) and out.is_contiguous() and out.dtype == x.dtype
    if num_tokens == 0:
        return out
    set_triton_allocator()
    bn = 2 * SWIGLU_BLOCK
    tiles = triton.cdiv(num_tokens, _BM) * (two_i // bn)
    num_sms = device_num_sms(x.device)
    _swiglu_gemm_kernel[(min(num_sms, tiles),)](
        x, weight, out, num_tokens, two_i, k, NUM_SMS=num_sms, BM=_BM, BN=bn, BK=_BK, GROUP_M=_GROUP_M,
        num_warps=_WARPS, num_stages=_STAGES,
    )  # fmt: skip
    return out


def swiglu_gemm_ref(x: Tensor, weight: Tensor) -> Tensor:  # [num_tokens, K], [2I, K] interleaved -> [n, I]
    """Torch reference: the GEMM in fp32, rounded to the dtype, then F.silu(gate) * up in the dtype."""
    gate, up = (x.float() @ deinterleave_gate_up(weight).float().t()).to(x.dtype).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
