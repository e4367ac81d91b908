"""The fused residual add + LayerNorm kernel (GPT-2 blocks) against its torch reference: on CUDA with fresh
random inputs (strided rows, odd widths), on CPU under the Triton interpreter in a subprocess, and the dispatch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import layer_norm as ln
from tests.child_env import child_env
from tests.kernels.test_fused_ops import DTYPES, ROOT, assert_matches, randn, strided

CASES = [(1, 64), (7, 768), (130, 1024), (5, 1000), (3, 4096)]  # num_tokens, hidden


def check_layer_norm(
    dtype: torch.dtype, num_tokens: int, hidden: int, with_residual: bool, device: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = strided(randn((num_tokens, hidden), gen, dtype, device) * 3 + 1)  # an offset mean, as real activations
    weight = 1 + 0.1 * randn((hidden,), gen, dtype, device)
    bias = 0.1 * randn((hidden,), gen, dtype, device)
    if not with_residual:
        assert_matches(ln.layer_norm_triton(x, weight, bias, 1e-5), ln.layer_norm_ref(x, weight, bias, 1e-5), "ln")
        return
    residual = strided(randn((num_tokens, hidden), gen, dtype, device))
    out, summed = ln.layer_norm_triton(x, weight, bias, 1e-5, residual)
    ref, ref_summed = ln.layer_norm_ref(x, weight, bias, 1e-5, residual)
    assert torch.equal(summed, ref_summed), "x + residual differs from torch's"
    assert_matches(out, ref, "layer_norm after the residual add")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_layer_norm_matches_reference(dtype: str, with_residual: bool, case: tuple[int, int]) -> None:
    check_layer_norm(DTYPES[dtype], *case, with_residual=with_residual, device="cuda", seed=hash(case) % 1000)


@pytest.mark.gpu
def test_dispatch_uses_the_kernel_on_cuda() -> None:
    gen = torch.Generator().manual_seed(1)
    x, residual = randn((6, 768), gen, torch.bfloat16, "cuda"), randn((6, 768), gen, torch.bfloat16, "cuda")
    w, b = randn((768,), gen, torch.bfloat16, "cuda"), randn((768,), gen, torch.bfloat16, "cuda")
    assert torch.equal(ln.layer_norm(x, w, b, 1e-5), ln.layer_norm_triton(x, w, b, 1e-5))
    fused, launched = ln.layer_norm(x, w, b, 1e-5, residual), ln.layer_norm_triton(x, w, b, 1e-5, residual)
    assert isinstance(fused, tuple) and isinstance(launched, tuple)
    assert all(torch.equal(got, want) for got, want in zip(fused, launched, strict=True))


def test_cpu_tensors_take_the_torch_path() -> None:
    gen = torch.Generator().manual_seed(2)
    x, residual = randn((5, 64), gen, torch.float32, "cpu"), randn((5, 64), gen, torch.float32, "cpu")
    w, b = randn((64,), gen, torch.float32, "cpu"), randn((64,), gen, torch.float32, "cpu")
    assert torch.equal(ln.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (64,), w, b, 1e-5))
    out, summed = ln.layer_norm(x, w, b, 1e-5, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(out, F.layer_norm(x + residual, (64,), w, b, 1e-5))


def _interpreter_checks() -> None:
    for dtype in (torch.float32, torch.float16):
        check_layer_norm(dtype, 3, 768, with_residual=False, device="cpu", seed=1)
        check_layer_norm(dtype, 4, 100, with_residual=True, device="cpu", seed=2)
    print("interpreter checks passed")


@pytest.mark.slow
def test_kernel_matches_reference_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = child_env(TRITON_INTERPRET="1")
    code = "from tests.kernels.test_layer_norm import _interpreter_checks; _interpreter_checks()"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "interpreter checks passed" in run.stdout
