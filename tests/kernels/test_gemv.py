"""kernels/gemv.py, the one-row projection (with its SwiGLU prologue), against fp32 torch math; the layers that
dispatch to it at one row and to cuBLAS otherwise. GPU tests on CUDA; the kernel's math also under the Triton
interpreter on CPU, in a subprocess (TRITON_INTERPRET must be set before triton is imported). The push epilogue
(a TP group's fused sum) is tested with two ranks in tests/gpu/test_tensor_parallel_cuda.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels.gemv import GemvConfig, gemv, gemv_fits, gemv_ref, tiling
from tests.child_env import child_env

ROOT = Path(__file__).resolve().parents[2]
CASES = [(3072, 4096, 0), (4096, 2048, 0), (4096, 7168, 128), (256, 1024, 64), (576, 576, 0), (64, 1536, 128)]
"""(N, K, SwiGLU half): TP 2 shares of the 8B shape's q/k/v, o and down projections, small ones (SmolLM2's
576-wide o projection: 64-column loop steps)."""


def check_gemv(
    n: int, k: int, half: int, dtype: torch.dtype, device: str, config: GemvConfig | None, seed: int,
    with_bias: bool = False,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(device=device, dtype=dtype)
    x = (torch.randn(1, 2 * k if half else k, generator=gen) * 2).to(device=device, dtype=dtype)
    bias = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if with_bias else None
    got, want = gemv(x, weight, half, config, bias=bias), gemv_ref(x, weight, half, bias)
    assert got.shape == (1, n) and got.dtype == dtype
    # NOTE: both sum in fp32 and round once; only the order differs (and SiLU's exp approximation): ~1 ulp
    tol = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", CASES, ids=[f"{n}x{k}/{h}" for n, k, h in CASES])
def test_gemv_matches_fp32_math(case: tuple[int, int, int], dtype: torch.dtype) -> None:
    check_gemv(*case, dtype, "cuda", None, seed=sum(case))
    check_gemv(*case, dtype, "cuda", None, seed=sum(case) + 1, with_bias=True)  # Qwen2's q/k/v


@pytest.mark.gpu
def test_gemv_in_a_cuda_graph_equals_eager() -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    weight = torch.randn(4096, 7168, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = torch.randn(1, 2 * 7168, device="cuda", dtype=torch.bfloat16, generator=gen)
    eager = gemv(x, weight, 128)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv(x, weight, 128)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
def test_layers_take_the_gemv_at_one_row_and_cublas_otherwise() -> None:
    from pdserve.core.models.layers import MergedLinear, RowParallelLinear
    from pdserve.core.parallel import Shard

    torch.manual_seed(0)
    merged = MergedLinear(1024, {"a": Shard(0, 0, 512, 512), "b": Shard(0, 0, 512, 512)}, bias=True)
    down = RowParallelLinear(1024, 512, bias=False)
    for layer in (merged, down):
        layer.to(device="cuda", dtype=torch.bfloat16)
    one, two = (torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16) for rows in (1, 2))
    assert torch.equal(merged(one), gemv(one, merged.weight, bias=merged.bias))
    assert torch.equal(merged(two), torch.nn.functional.linear(two, merged.weight, merged.bias))
    gate_up = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(down(gate_up, swiglu=128), gemv(gate_up, down.weight, 128))
    from pdserve.kernels.fused_ops import silu_and_mul_blocks

    two_gate_up = torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16)
    want = torch.nn.functional.linear(silu_and_mul_blocks(two_gate_up, 128), down.weight)
    assert torch.equal(down(two_gate_up, swiglu=128), want)


def test_gemv_fits_one_16_bit_row_of_whole_tiles_on_cuda_only() -> None:
    weight = torch.empty(8, 2048, dtype=torch.bfloat16)
    assert not gemv_fits(torch.empty(1, 2048, dtype=torch.bfloat16), weight)  # CPU: the torch path
    if not torch.cuda.is_available():
        return
    weight = weight.cuda()
    assert gemv_fits(torch.empty(1, 2048, dtype=torch.bfloat16, device="cuda"), weight)
    assert gemv_fits(torch.empty(1, 4096, dtype=torch.bfloat16, device="cuda"), weight, half=128)
    assert not gemv_fits(torch.empty(2, 2048, dtype=torch.bfloat16, device="cuda"), weight)
    assert not gemv_fits(torch.empty(1, 2048, dtype=torch.float16, device="cuda"), weight)  # mixed dtypes
    assert not gemv_fits(torch.empty(1, 1000, dtype=torch.bfloat16, device="cuda"), weight[:, :1000])  # K % 16
    assert not gemv_fits(torch.empty(1, 2048, dtype=torch.bfloat16, device="cuda"), weight[:6])  # N % 4


def test_tiling_takes_the_widest_loop_step_up_to_1024_that_divides_k() -> None:
    assert tiling(4096) == GemvConfig(4, 1024, 4)
    assert tiling(7168) == GemvConfig(4, 1024, 4)
    assert tiling(576) == GemvConfig(4, 64, 4)
    assert tiling(1000) is None


def _interpreter_checks() -> None:
    small = GemvConfig(8, 32, 1)
    for dtype in (torch.bfloat16, torch.float16):
        check_gemv(32, 128, 0, dtype, "cpu", small, seed=1)
        check_gemv(16, 64, 16, dtype, "cpu", small, seed=2)
        check_gemv(32, 128, 0, dtype, "cpu", small, seed=3, with_bias=True)
    print("interpreter checks passed")


@pytest.mark.slow
def test_gemv_matches_fp32_math_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    code = "from tests.kernels.test_gemv import _interpreter_checks; _interpreter_checks()"
    env = child_env(TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "interpreter checks passed" in run.stdout
