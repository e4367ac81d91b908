"""The decode-path Triton kernels (KV append, paged decode attention) against their torch references.

GPU tests run on CUDA with fresh random inputs. The same checks run on CPU under the Triton interpreter in a
subprocess (TRITON_INTERPRET must be set before triton is imported, so never in the pytest process).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.child_env import child_env

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def random_cache(
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
) -> torch.Tensor:  # [2, num_blocks, block_size, kv_heads, head_dim]
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def random_tables(lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Block tables with distinct random non-null blocks per sequence, padded with 0. [batch, max_blocks]"""
    max_blocks = max(1, max(-(-n // block_size) for n in lens))
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), max_blocks + 1, dtype=torch.int32)  # one spare column of padding
    for i, n in enumerate(lens):
        need = -(-n // block_size)
        tables[i, :need] = torch.tensor([perm.pop() for _ in range(need)], dtype=torch.int32)
    return tables


def check_decode(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    block_size: int,
    head_dim: int,
    lens: list[int],
    splits: int | None,
    device: str,
    seed: int,
) -> float:
    from pdserve.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 8
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device, gen)
    tables = random_tables(lens, block_size, num_blocks, gen).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, tables, seq_lens, head_dim**-0.5, out=out, num_splits=splits)
    ref = paged_decode_attention_ref(q, cache, tables, seq_lens, head_dim**-0.5)
    assert not out.isnan().any(), "unwritten or NaN output"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"relative error {err:.2e}"
    return err


def check_append(mode: str, dtype: torch.dtype, device: str, seed: int, rope: bool = False) -> None:
    """append_kv == append_kv_ref: the cache, and with rope the rotated K returned (bit for bit: each rope
    product and the sum round as torch's do)."""
    from pdserve.kernels.kv_append import append_kv, append_kv_ref
    from pdserve.kernels.rope_tiles import RopeTables

    gen = torch.Generator().manual_seed(seed)
    block_size, kv_heads, head_dim, num_blocks = 16, 3, 64, 40  # 3 heads: a row that is not a power of two
    lens = [1, 16, 17, 40, 33]
    tables = random_tables(lens, block_size, num_blocks, gen).to(device)
    n, slots = len(lens), None
    if mode == "positions":
        positions, block_tables = torch.tensor([x - 1 for x in lens], device=device), tables
    elif mode == "shared":
        positions, block_tables = torch.tensor([12], device=device), tables
    else:
        n, block_tables = 37, None
        slots = (torch.randperm(num_blocks * block_size, generator=gen)[:n]).to(device)
        positions = torch.randint(0, 5000, (n,), generator=gen).to(device)
    # q, k and v as strided views of a fused qkv projection, as the model hands them over (5 query heads)
    width = (5 + 2 * kv_heads) * head_dim
    qkv = torch.randn(n, width + 8, generator=gen).to(device=device, dtype=dtype)
    q, k, v = (t.view(n, -1, head_dim) for t in qkv[:, :width].split([5 * head_dim, *[kv_heads * head_dim] * 2], -1))
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device, gen)
    expected = cache.clone()
    freqs = torch.outer(torch.arange(5000.0), 500000.0 ** (-torch.arange(0, head_dim, 2) / head_dim))
    emb = torch.cat((freqs, freqs), -1)
    rope_tables = RopeTables(emb.cos().to(device), emb.sin().to(device)) if rope else None
    q_in = q if rope else None  # rotated beside k (the backend asks for it in prefill passes)
    k_ref, q_ref = append_kv_ref(k, v, expected, slots, positions, block_tables, rope_tables, q_in)
    pos_in = positions if slots is None or rope else None
    k_out, q_out = append_kv(k, v, cache, slots, pos_in, block_tables, rope_tables, q_in)
    what = f"append ({mode}, rope {rope})"
    assert torch.equal(cache, expected), f"{what} differs from the reference"
    assert torch.equal(k_out, k_ref), f"{what} returned another K"
    assert (q_out is None) == (q_ref is None) == (q_in is None), f"{what}: q rotated or not"
    if q_out is not None and q_ref is not None:
        assert torch.equal(q_out, q_ref), f"{what}: q rotated differently"


DECODE_CASES = [
    # heads, kv_heads, block_size, head_dim, lengths, splits
    (4, 4, 16, 64, [1, 7, 16, 17, 33], None),
    (8, 2, 16, 64, [5, 64, 65, 1], 3),
    (32, 8, 16, 128, [1, 300, 4099, 17], None),
    (12, 12, 32, 64, [2048, 31, 32, 33], 8),
    (16, 2, 16, 128, [8192, 1], None),
    (4, 1, 8, 32, [0, 9, 1], 2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_paged_decode_attention_matches_reference(dtype: str, case: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    check_decode(DTYPES[dtype], *DECODE_CASES[case], device="cuda", seed=100 + case)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 64, 200])
def test_split_heuristic_equals_one_split(batch: int) -> None:
    lens = [(i * 997) % 3000 + 1 for i in range(batch)]
    check_decode(torch.bfloat16, 16, 4, 16, 64, lens, None, "cuda", seed=batch)
    check_decode(torch.bfloat16, 16, 4, 16, 64, lens, 1, "cuda", seed=batch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("mode", ["slots", "positions", "shared"])
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
def test_append_kv_matches_reference(mode: str, dtype: str, rope: bool) -> None:
    check_append(mode, DTYPES[dtype], "cuda", seed=7, rope=rope)


def _interpreter_checks() -> None:
    for mode in ("slots", "positions", "shared"):
        check_append(mode, torch.float32, "cpu", seed=1)
        check_append(mode, torch.float16, "cpu", seed=1, rope=True)
    check_decode(torch.float32, 4, 2, 4, 16, [1, 5, 8, 9], None, "cpu", seed=2)
    check_decode(torch.float32, 4, 1, 8, 32, [0, 17, 3], 3, "cpu", seed=3)
    check_decode(torch.float16, 8, 2, 16, 16, [70, 2], 2, "cpu", seed=4)
    print("interpreter checks passed")


@pytest.mark.slow
def test_kernels_match_reference_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = child_env(TRITON_INTERPRET="1")
    code = "from tests.kernels.test_decode_kernels import _interpreter_checks; _interpreter_checks()"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "interpreter checks passed" in run.stdout
