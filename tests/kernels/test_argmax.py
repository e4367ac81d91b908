"""kernels/argmax.py: the split-vocabulary argmax equals torch.argmax (first index of the maximum) on fresh
random rows, ties across chunks, a maximum in the last partial chunk, -inf rows and NaN; CPU tensors take
torch's path; the same kernels under the Triton interpreter on CPU (in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.argmax import CHUNK, ROW_COUNTERS, argmax

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(1, 128256), (8, 128256), (3, 50257), (128, 50304), (5, 49152), (2, 17), (4, CHUNK), (2, CHUNK + 1)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check(rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen).to(device=device, dtype=dtype)
    assert torch.equal(argmax(x).cpu(), x.argmax(dim=-1).cpu()), f"{rows}x{vocab} {dtype}"
    if vocab > CHUNK:  # a tie across two chunks: the first one wins
        x[:, vocab - 1] = x[:, 1] = 100.0
        assert torch.equal(argmax(x).cpu(), torch.full((rows,), 1)), "tie across chunks"
        x[:, vocab - 1] = 200.0  # the maximum alone in the last, partial chunk
        assert torch.equal(argmax(x).cpu(), torch.full((rows,), vocab - 1)), "last chunk"
    x[0] = float("-inf")  # a row of -inf: index 0, as torch
    x[-1, vocab // 2] = float("nan")  # NaN wins, as torch
    assert torch.equal(argmax(x).cpu(), x.argmax(dim=-1).cpu()), "-inf row / NaN"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{v}" for r, v in SHAPES])
def test_argmax_matches_torch_on_cuda(shape: tuple[int, int], dtype: torch.dtype) -> None:
    check(*shape, dtype, "cuda", seed=shape[1] + shape[0])
    assert not ROW_COUNTERS[torch.device("cuda", torch.cuda.current_device())].any(), "counters left non-zero"


@pytest.mark.gpu
def test_argmax_of_a_strided_row_view_and_no_rows() -> None:
    x = torch.randn(6, 1000, device="cuda")[::2, :900]  # rows strided, columns contiguous
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert argmax(torch.empty(0, 10, device="cuda")).shape == (0,)


def test_cpu_tensors_take_torch() -> None:
    x = torch.randn(3, 100)
    assert torch.equal(argmax(x), x.argmax(dim=-1))


def _interpreter_checks() -> None:
    from kernels.argmax import argmax_triton

    for rows, vocab in ((2, 2 * CHUNK + 5), (3, 17)):
        x = torch.randn(rows, vocab)
        x[0, vocab - 1] = x[0, 0] = 50.0
        assert torch.equal(argmax_triton(x), x.argmax(dim=-1))
    print("interpreter checks passed")


def test_argmax_kernels_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    code = "from tests.kernels.test_argmax import _interpreter_checks; _interpreter_checks()"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "interpreter checks passed" in run.stdout
