"""The attention and KV-append kernels compile for Hopper (sm_90) on a machine without a GPU, ahead of time, and
the 16-bit prefill kernel keeps its fast path there (TMA loads, warpgroup MMAs); the kernels of the one-row decode
chain, launched with programmatic dependent launch, wait on the kernel before them before they write anything or
read what it may have written.

The Triton interpreter runs the kernels' logic on the CPU but not Triton's compiler: a kernel can pass every
interpreter test and still fail to compile (a Python int global read inside a jit function did). Triton ships
ptxas, so `triton.compile` for a GPUTarget needs no device. Signatures here leave out the alignment hints a
launch adds, so this checks compiling, not the exact variant a GPU builds.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import pdserve.kernels.allreduce_norm as allreduce_norm  # noqa: E402
import pdserve.kernels.decode_attention as decode_attention  # noqa: E402
import pdserve.kernels.fused_ops as fused_ops  # noqa: E402
import pdserve.kernels.gemv as gemv  # noqa: E402
import pdserve.kernels.kv_append as kv_append  # noqa: E402
import pdserve.kernels.prefill_attention as prefill_attention  # noqa: E402
import pdserve.kernels.prefill_splits as prefill_splits  # noqa: E402
import pdserve.kernels.split_policy as split_policy  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
INT_POINTERS = ("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr")
FP32_POINTERS = ("part_out_ptr", "part_lse_ptr")


def compile_sm90(
    fn: Any, dtype: str, constexprs: dict[str, Any], types: dict[str, str] | None = None, **options: Any
) -> str:
    """PTX of fn for sm_90: pointers by name (int32 tables, fp32 partials, `dtype` data) unless `types` names
    them, fp32 scales, i32 ints."""
    signature = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif types and name in types:
            signature[name] = types[name]
        elif name.endswith("_ptr"):
            signature[name] = "*i32" if name in INT_POINTERS else "*fp32" if name in FP32_POINTERS else f"*{dtype}"
        else:
            signature[name] = "fp32" if name.endswith("scale") else "i32"
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=SM90, options=options)
    return str(kernel.asm["ptx"])


PREFILL = dict(HEAD_DIM=64, BLOCK_SIZE=16, BLOCK_M=64, MIN_TILES=split_policy.MIN_SPLIT_TILES)
DECODE = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=64, BLOCK_SIZE=16, TILE_N=128, DOT_PRECISION="tf32")
MERGE = dict(HEAD_DIM=64, SPLITS_PAD=8)
APPEND = dict(NUM_KV_HEADS=8, HEAD_DIM=64, ROW_PAD=512, BLOCK_SIZE=16, ROPE=True, HEADS_PAD=8, D_PAD=64, NUM_HEADS=32,
              Q_HEADS_PAD=32)  # fmt: skip
APPEND_TYPES = {"index_ptr": "*i64", "positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}


def test_bf16_prefill_kernel_compiles_for_sm90_with_tma_and_warpgroup_mma() -> None:
    consts = dict(PREFILL, BLOCK_N=64, TMA=True, DOT_PRECISION="tf32")
    ptx = compile_sm90(prefill_attention._prefill_kernel, "bf16", consts, num_warps=4, num_stages=2)
    assert "cp.async.bulk.tensor" in ptx, "the new tokens' q/K/V no longer load through TMA"
    assert "wgmma.mma_async" in ptx, "the dots no longer run as warpgroup MMAs"


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_prefill_kernel_compiles_for_sm90_with_pointer_loads(dtype: str) -> None:
    precision, block_n = ("ieee", 32) if dtype == "fp32" else ("tf32", 64)
    consts = dict(PREFILL, BLOCK_N=block_n, TMA=False, DOT_PRECISION=precision)
    ptx = compile_sm90(prefill_attention._prefill_kernel, dtype, consts, num_warps=4, num_stages=2)
    assert "cp.async.bulk.tensor" not in ptx


def test_split_merge_kernel_compiles_for_sm90() -> None:
    consts = dict(HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64, MIN_TILES=split_policy.MIN_SPLIT_TILES)
    assert ".entry _merge_kernel" in compile_sm90(prefill_splits._merge_kernel, "bf16", consts, num_warps=4)


@pytest.mark.parametrize(("split", "rope"), [(False, True), (True, False)])
def test_decode_kernels_compile_for_sm90(split: bool, rope: bool) -> None:
    consts = dict(DECODE, SPLIT=split, ROPE=rope, PDL=False)
    assert ".entry _decode_stage1" in compile_sm90(decode_attention._decode_stage1, "bf16", consts, num_warps=4)
    stage2 = compile_sm90(decode_attention._decode_stage2, "bf16", dict(MERGE, PDL=False), num_warps=4)
    assert ".entry _decode_stage2" in stage2


@pytest.mark.parametrize(("mode", "rope_q"), [(0, True), (1, False), (2, False)], ids=["slots", "positions", "one"])
def test_kv_append_compiles_for_sm90(mode: int, rope_q: bool) -> None:
    consts = dict(APPEND, MODE=mode, ROPE_Q=rope_q, PDL=False)
    ptx = compile_sm90(kv_append._append_kv, "bf16", consts, APPEND_TYPES, num_warps=4, enable_fp_fusion=False)
    assert ".entry _append_kv" in ptx


SENTINEL16 = dict(INT=tl.int16, SENTINEL=allreduce_norm.SENTINEL_BITS[16])
PEERS = dict(RANK=0, WORLD=2, SLOTS=allreduce_norm.SLOTS, **SENTINEL16)
CHAIN = {
    "rms_norm": (fused_ops._rms_norm_kernel, dict(BLOCK=4096, HAS_RESIDUAL=True), {"eps": "fp32"}, dict(num_warps=16)),
    "fused_sum": (
        allreduce_norm._all_reduce_rms_norm_kernel,
        dict(PEERS, PROGRAMS=allreduce_norm.PROGRAMS, BLOCK=4096, TIMEOUT_NS=allreduce_norm.SPIN_TIMEOUT_NS,
             PUSHED=False),
        {"buffer_ptrs": "*i64", "slot_rows_ptr": "*i32", "epochs_ptr": "*i32", "eps": "fp32"},
        dict(num_warps=16),
    ),
    "gemv": (
        gemv._gemv_kernel,
        dict(PEERS, HALF=128, HAS_BIAS=False, BLOCK_N=4, BLOCK_K=1024, PUSH=True),
        {"buffer_ptrs": "*i64", "epochs_ptr": "*i32"},
        dict(num_warps=4, num_stages=1),
    ),
    "kv_append": (kv_append._append_kv, dict(APPEND, MODE=1, ROPE_Q=False), APPEND_TYPES,
                  dict(num_warps=4, enable_fp_fusion=False)),
    "decode_stage1": (decode_attention._decode_stage1, dict(DECODE, SPLIT=True, ROPE=True), None, dict(num_warps=4)),
    "decode_stage2": (decode_attention._decode_stage2, MERGE, None, dict(num_warps=4)),
}  # fmt: skip
"""The kernels of a one-row decode step, each as (kernel, constexprs but PDL, pointer types, launch options)."""


def compile_chain_kernel(name: str, pdl: bool) -> str:
    fn, consts, types, options = CHAIN[name]
    return compile_sm90(fn, "bf16", dict(consts, PDL=pdl), types, **options)


@pytest.mark.parametrize("name", list(CHAIN))
def test_chain_kernels_without_pdl_have_no_grid_dependency_control(name: str) -> None:
    assert "griddepcontrol" not in compile_chain_kernel(name, pdl=False)


@pytest.mark.parametrize("name", list(CHAIN))
def test_chain_kernels_with_pdl_wait_before_any_write_or_input_read(name: str) -> None:
    """griddepcontrol.wait lies in the entry block (no branch or branch target before it: it precedes everything
    else the kernel runs) with no global store or atomic before it, and no global load but gemv's first weight
    tile; dependents are let launch after it."""
    ptx = compile_chain_kernel(name, pdl=True)
    head, wait, tail = ptx[ptx.index(".entry") :].partition("griddepcontrol.wait")
    assert wait, "no griddepcontrol.wait"
    assert "griddepcontrol.launch_dependents" in tail
    assert not re.search(r"\bbra\b|\$L__BB", head), "the wait is not in the entry block"
    assert not re.search(r"\bst\.|\batom\.|\bred\.", head), "a store before the wait"
    assert ("ld.global" in head) == (name == "gemv"), "a global load before the wait (gemv: its first weight tile)"
    assert "ld.volatile" not in head
