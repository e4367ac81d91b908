"""The fused Llama-block kernels (RMSNorm with residual add, SiLU-and-mul) against their torch references.

GPU tests run on CUDA with fresh random inputs, written into NaN-poisoned strided outputs. The same checks run
on CPU under the Triton interpreter in a subprocess (TRITON_INTERPRET must be set before triton is imported,
so never in the pytest process). The dispatch tests pin that CPU tensors take the torch path unchanged and
that the model imports where triton is not installed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels import fused_ops
from tests.child_env import child_env

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PAD = 8
"""Extra columns of every strided input and output buffer; the output's stay NaN."""


def assert_matches(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """fp32 within 1e-5 relative; fp16/bf16 within two ulps of the dtype (one rounding step each side)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"{what}: {out.dtype}{tuple(out.shape)} vs {ref.dtype}"
    if ref.dtype == torch.float32:
        rtol, atol = 1e-5, 1e-6
    else:
        eps = torch.finfo(ref.dtype).eps
        rtol, atol = 2 * eps, 2 * eps
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def randn(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def strided(t: torch.Tensor) -> torch.Tensor:
    """t as a view of a wider buffer: rows PAD elements apart more than their length."""
    buf = torch.zeros(t.shape[0], t.shape[1] + PAD, dtype=t.dtype, device=t.device)
    buf[:, : t.shape[1]] = t
    return buf[:, : t.shape[1]]


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): a NaN buffer PAD columns wider than the [rows, cols] output view."""
    buf = torch.full((shape[0], shape[1] + PAD), float("nan"), dtype=dtype, device=device)
    return buf, buf[:, : shape[1]]


def assert_pad_untouched(buf: torch.Tensor, cols: int, what: str) -> None:
    assert buf[:, cols:].isnan().all(), f"{what}: wrote past the end of its rows"


def check_rms_norm(
    dtype: torch.dtype, num_tokens: int, hidden: int, with_residual: bool, device: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = strided(randn((num_tokens, hidden), gen, dtype, device) * 3)
    weight = 1 + 0.1 * randn((hidden,), gen, dtype, device)
    out_buf, out = poisoned((num_tokens, hidden), dtype, device)
    if not with_residual:
        fused_ops.rms_norm_triton(x, weight, 1e-6, out=out)
        assert_matches(out, fused_ops.rms_norm_ref(x, weight, 1e-6), "rms_norm")
    else:
        residual = randn((num_tokens, hidden), gen, dtype, device)
        res_buf, res_out = poisoned((num_tokens, hidden), dtype, device)
        fused_ops.rms_norm_triton(x, weight, 1e-6, residual, out=out, residual_out=res_out)
        ref, ref_residual = fused_ops.rms_norm_ref(x, weight, 1e-6, residual)
        assert torch.equal(res_out, ref_residual), "x + residual differs from torch's"
        assert_matches(out, ref, "rms_norm after the residual add")
        assert_pad_untouched(res_buf, hidden, "residual_out")
    assert_pad_untouched(out_buf, hidden, "rms_norm out")


def check_silu_and_mul(dtype: torch.dtype, num_tokens: int, inter: int, device: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    gate_up = randn((num_tokens, 2 * inter), gen, dtype, device) * 3  # a merged projection's output
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    out_buf, out = poisoned((num_tokens, inter), dtype, device)
    fused_ops.silu_and_mul_triton(gate, up, out=out)
    assert_matches(out, fused_ops.silu_and_mul_ref(gate, up), "silu_and_mul")
    assert_pad_untouched(out_buf, inter, "silu_and_mul out")


def check_silu_and_mul_blocks(
    dtype: torch.dtype, num_tokens: int, inter: int, half: int, device: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    gate_up = strided(randn((num_tokens, 2 * inter), gen, dtype, device) * 3)  # a GEMM over an interleaved weight
    out_buf, out = poisoned((num_tokens, inter), dtype, device)
    fused_ops.silu_and_mul_blocks_triton(gate_up, half, out=out)
    assert_matches(out, fused_ops.silu_and_mul_blocks_ref(gate_up, half), "silu_and_mul_blocks")
    assert_pad_untouched(out_buf, inter, "silu_and_mul_blocks out")
    blocks = gate_up.reshape(num_tokens, -1, 2, half)
    gate, up = (blocks[:, :, i].reshape(num_tokens, inter) for i in (0, 1))
    assert torch.equal(out, fused_ops.silu_and_mul_triton(gate, up)), "blocks differ from the stacked layout's"


RMS_CASES = [(1, 64), (7, 576), (130, 2048), (9, 5120), (3, 8192)]  # num_tokens, hidden
SILU_CASES = [(1, 64), (5, 1536), (17, 8192), (3, 11008)]  # num_tokens, intermediate
SILU_BLOCK_CASES = [(1, 128, 64), (5, 1536, 128), (33, 8192, 128), (3, 256, 128)]  # num_tokens, intermediate, half


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize("case", RMS_CASES, ids=[f"{n}x{h}" for n, h in RMS_CASES])
def test_rms_norm_matches_reference(dtype: str, with_residual: bool, case: tuple[int, int]) -> None:
    check_rms_norm(DTYPES[dtype], *case, with_residual=with_residual, device="cuda", seed=case[1])


@pytest.mark.gpu
def test_rms_norm_output_dtype_follows_torch_promotion() -> None:
    gen = torch.Generator().manual_seed(0)
    x = randn((4, 576), gen, torch.bfloat16, "cuda")
    weight = 1 + 0.1 * randn((576,), gen, torch.float32, "cuda")
    out = fused_ops.rms_norm_triton(x, weight, 1e-5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, fused_ops.rms_norm_ref(x, weight, 1e-5), rtol=1e-2, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", SILU_CASES, ids=[f"{n}x{i}" for n, i in SILU_CASES])
def test_silu_and_mul_matches_reference(dtype: str, case: tuple[int, int]) -> None:
    check_silu_and_mul(DTYPES[dtype], *case, device="cuda", seed=case[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", SILU_BLOCK_CASES, ids=[f"{n}x{i}/{h}" for n, i, h in SILU_BLOCK_CASES])
def test_silu_and_mul_over_interleaved_blocks_matches_reference(dtype: str, case: tuple[int, int, int]) -> None:
    check_silu_and_mul_blocks(DTYPES[dtype], *case, device="cuda", seed=case[1])


@pytest.mark.gpu
def test_dispatch_uses_the_kernels_on_cuda() -> None:
    gen = torch.Generator().manual_seed(1)
    x, residual = randn((6, 576), gen, torch.bfloat16, "cuda"), randn((6, 576), gen, torch.bfloat16, "cuda")
    weight = randn((576,), gen, torch.bfloat16, "cuda")
    assert torch.equal(fused_ops.rms_norm(x, weight, 1e-6), fused_ops.rms_norm_triton(x, weight, 1e-6))
    fused = fused_ops.rms_norm(x, weight, 1e-6, residual)
    for got, want in zip(fused, fused_ops.rms_norm_triton(x, weight, 1e-6, residual), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(fused_ops.silu_and_mul(x, residual), fused_ops.silu_and_mul_triton(x, residual))


def test_cpu_tensors_take_the_torch_path() -> None:
    gen = torch.Generator().manual_seed(2)
    x, residual = randn((5, 64), gen, torch.float32, "cpu"), randn((5, 64), gen, torch.float32, "cpu")
    weight = randn((64,), gen, torch.float32, "cpu")
    dtype = x.dtype
    x32 = x.float()
    want = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(fused_ops.rms_norm(x, weight, 1e-6), want)
    out, new_residual = fused_ops.rms_norm(residual, weight, 1e-6, x - residual)
    assert torch.equal(new_residual, residual + (x - residual))
    assert torch.equal(out, fused_ops.rms_norm_ref(new_residual, weight, 1e-6))
    assert torch.equal(fused_ops.silu_and_mul(x, residual), torch.nn.functional.silu(x) * residual)


def test_models_import_and_run_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch\n"
        "from core.models import llama, rope\n"
        "from kernels import attention\n"
        "from kernels import fused_ops\n"
        "assert fused_ops.triton is None\n"
        "x, w = torch.randn(3, 64), torch.ones(64)\n"
        "assert torch.equal(fused_ops.rms_norm(x, w, 1e-6), fused_ops.rms_norm_ref(x, w, 1e-6))\n"
        "print('imported without triton')\n"
    )
    env = child_env()
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "imported without triton" in run.stdout


def _interpreter_checks() -> None:
    for dtype in (torch.float32, torch.float16):
        check_rms_norm(dtype, 3, 576, with_residual=False, device="cpu", seed=1)
        check_rms_norm(dtype, 4, 64, with_residual=True, device="cpu", seed=2)
        check_silu_and_mul(dtype, 3, 1536, device="cpu", seed=3)
        check_silu_and_mul_blocks(dtype, 3, 768, 128, device="cpu", seed=4)
    print("interpreter checks passed")


@pytest.mark.slow
def test_kernels_match_reference_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = child_env(TRITON_INTERPRET="1")
    code = "from tests.kernels.test_fused_ops import _interpreter_checks; _interpreter_checks()"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "interpreter checks passed" in run.stdout
