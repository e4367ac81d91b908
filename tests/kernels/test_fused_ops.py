"""The fused Llama-block kernels (RMSNorm with residual add, SiLU-and-mul, rope) against their torch references.

GPU tests run on CUDA with fresh random inputs, written into NaN-poisoned strided outputs. The same checks run
on CPU under the Triton interpreter in a subprocess (TRITON_INTERPRET must be set before triton is imported,
so never in the pytest process). The dispatch tests pin that CPU tensors take the torch path unchanged and
that the model imports where triton is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import fused_ops

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


def rope_tables(head_dim: int, max_positions: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_positions, head_dim] fp32 cos and sin, built as RotaryEmbedding builds them (scale 1)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def check_rope(
    dtype: torch.dtype,
    num_tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    max_positions: int,
    device: str,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    qkv = randn((num_tokens, (heads + 2 * kv_heads) * head_dim), gen, dtype, device)  # a fused qkv projection
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)  # non-contiguous views
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen)
    positions[: min(2, num_tokens)] = torch.tensor([max_positions - 1, 0])[: min(2, num_tokens)]
    positions = positions.to(device)
    cos, sin = rope_tables(head_dim, max_positions, device)
    q_buf, q_out = poisoned((num_tokens, heads * head_dim), dtype, device)
    k_buf, k_out = poisoned((num_tokens, kv_heads * head_dim), dtype, device)
    q_view, k_view = q_out.view(num_tokens, heads, head_dim), k_out.view(num_tokens, kv_heads, head_dim)
    fused_ops.apply_rope_triton(positions, q, k, cos, sin, q_out=q_view, k_out=k_view)
    q_ref, k_ref = fused_ops.apply_rope_ref(positions, q, k, cos, sin)
    assert_matches(q_view, q_ref, "rope q")
    assert_matches(k_view, k_ref, "rope k")
    assert_pad_untouched(q_buf, heads * head_dim, "rope q_out")
    assert_pad_untouched(k_buf, kv_heads * head_dim, "rope k_out")


RMS_CASES = [(1, 64), (7, 576), (130, 2048), (9, 5120), (3, 8192)]  # num_tokens, hidden
SILU_CASES = [(1, 64), (5, 1536), (17, 8192), (3, 11008)]  # num_tokens, intermediate
ROPE_CASES = [
    # num_tokens, heads, kv_heads, head_dim, max_positions
    (1, 4, 4, 64, 2048),
    (37, 32, 8, 64, 4096),
    (5, 12, 2, 128, 8192),
    (9, 14, 2, 64, 32768),
    (3, 6, 1, 80, 4096),  # half of head_dim not a power of two
]


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
@pytest.mark.parametrize("case", range(len(ROPE_CASES)))
def test_apply_rope_matches_reference(dtype: str, case: int) -> None:
    check_rope(DTYPES[dtype], *ROPE_CASES[case], device="cuda", seed=200 + case)


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
    q, k = x.view(6, 9, 64), residual.view(6, 9, 64)[:, :3]
    positions = torch.arange(1000, 1006, device="cuda")
    cos, sin = rope_tables(64, 1024, "cuda")
    rotated = fused_ops.apply_rope(positions, q, k, cos, sin)
    for got, want in zip(rotated, fused_ops.apply_rope_triton(positions, q, k, cos, sin), strict=True):
        assert torch.equal(got, want)


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
    q, k = x.view(5, 4, 16), residual.view(5, 4, 16)[:, :2]
    positions = torch.tensor([0, 3, 1000, 7, 1023])
    cos, sin = rope_tables(16, 1024, "cpu")
    q_rot = torch.cat((-q[..., 8:], q[..., :8]), dim=-1)
    q_out, _ = fused_ops.apply_rope(positions, q, k, cos, sin)
    assert torch.equal(q_out, q * cos[positions][:, None] + q_rot * sin[positions][:, None])


def test_models_import_and_run_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch\n"
        "from core.models import llama, rope\n"
        "from kernels import fused_ops\n"
        "assert fused_ops.triton is None\n"
        "x, w = torch.randn(3, 64), torch.ones(64)\n"
        "assert torch.equal(fused_ops.rms_norm(x, w, 1e-6), fused_ops.rms_norm_ref(x, w, 1e-6))\n"
        "print('imported without triton')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "imported without triton" in run.stdout


def _interpreter_checks() -> None:
    for dtype in (torch.float32, torch.float16):
        check_rms_norm(dtype, 3, 576, with_residual=False, device="cpu", seed=1)
        check_rms_norm(dtype, 4, 64, with_residual=True, device="cpu", seed=2)
        check_silu_and_mul(dtype, 3, 1536, device="cpu", seed=3)
        check_rope(dtype, 6, 4, 2, 16, 2048, device="cpu", seed=4)
        check_rope(dtype, 2, 3, 1, 24, 1500, device="cpu", seed=5)
    print("interpreter checks passed")


def test_kernels_match_reference_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    code = "from tests.kernels.test_fused_ops import _interpreter_checks; _interpreter_checks()"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "interpreter checks passed" in run.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_rope_tables_in_the_model_dtype_give_the_same_result(dtype: str) -> None:
    """A model cast whole to bf16/fp16 holds its rope tables in that dtype: the kernel casts the tables to q's
    dtype first anyway, so those tables give what the fp32 ones give."""
    gen = torch.Generator().manual_seed(3)
    q = randn((37, 8, 64), gen, DTYPES[dtype], "cuda")
    k = randn((37, 2, 64), gen, DTYPES[dtype], "cuda")
    positions = torch.randint(0, 1024, (37,), generator=gen).cuda()
    cos, sin = rope_tables(64, 1024, "cuda")
    want = fused_ops.apply_rope_triton(positions, q, k, cos, sin)
    got = fused_ops.apply_rope_triton(positions, q, k, cos.to(q.dtype), sin.to(q.dtype))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
