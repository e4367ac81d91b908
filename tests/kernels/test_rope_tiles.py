"""Rope inside the attention backend: the Triton backend (K rotated in the KV append, q as the attention kernels
load it) against the torch backend (transformers' rope, then attention), and that rope against transformers'.

GPU tests run on CUDA; the same comparison runs on CPU under the Triton interpreter in a subprocess
(TRITON_INTERPRET must be set before triton is imported, so never in the pytest process).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from pdserve.kernels.attention import AttentionMetadata, MixedSplit, OutputRows, Rope, TorchAttention
from pdserve.kernels.rope_tiles import RopeTables, rope_ref_one
from tests.child_env import child_env

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rope_tables(head_dim: int, max_positions: int, device: str, theta: float = 500000.0) -> RopeTables:
    """[max_positions, head_dim] fp32 tables, built as RotaryEmbedding builds them (scale 1)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return RopeTables(emb.cos().to(device), emb.sin().to(device))


class Pass(NamedTuple):
    q: torch.Tensor  # [num_tokens, heads, head_dim], unrotated, a strided view of a fused qkv row
    k: torch.Tensor  # [num_tokens, kv_heads, head_dim], unrotated, strided
    v: torch.Tensor
    cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_dim]: random prefixes
    meta: AttentionMetadata
    positions: torch.Tensor  # [num_tokens] int64


def make_pass(
    cases: list[tuple[int, int]],  # (cached tokens, new tokens) per sequence
    dims: tuple[int, int, int, int],  # heads, kv_heads, head_dim, block_size
    dtype: torch.dtype,
    device: str,
    seed: int,
    decode: bool = False,  # no slot mapping: each sequence's one new token found through positions
) -> Pass:
    heads, kv_heads, head_dim, block_size = dims
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in cases]
    need = [-(-s // block_size) for s in seq_lens]
    free = (torch.randperm(sum(need) + 3, generator=gen) + 1).tolist()  # shuffled, never the null block
    width = max(need) + 1
    tables = torch.zeros(len(cases), width, dtype=torch.int32)
    slots: list[int] = []
    for i, ((cached, new), n) in enumerate(zip(cases, need, strict=True)):
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(cached, cached + new)]
    positions = torch.tensor([p for c, n in cases for p in range(c, c + n)], dtype=torch.int64)
    num_tokens = len(positions)
    shape = (2, sum(need) + 4, block_size, kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(device, dtype)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    starts = torch.tensor([0, *torch.tensor([n for _, n in cases]).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=None if decode else torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        query_lens=[n for _, n in cases],
        seq_lens_cpu=seq_lens,
        block_size=block_size,
        positions=positions.to(device) if decode else None,
    )
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    return Pass(q, k, v, cache, meta, positions.to(device))


def with_rows(p: Pass, seqs: list[int]) -> Pass:
    """The pass with output rows: the last new token of each of `seqs`, as ModelRunner builds them."""
    m = p.meta
    ends = m.query_start_loc[1:].long()
    index = ends[seqs] - 1
    row_meta = AttentionMetadata(
        slot_mapping=None,
        query_start_loc=torch.arange(len(seqs) + 1, dtype=torch.int32, device=index.device),
        seq_lens=m.seq_lens[seqs],
        block_tables=m.block_tables[seqs],
        query_lens=[1] * len(seqs),
        seq_lens_cpu=[m.seq_lens_cpu[i] for i in seqs],
        block_size=m.block_size,
    )
    meta = AttentionMetadata(**{**vars(m), "rows": OutputRows(index, row_meta), "plan": None})
    return p._replace(meta=meta)


def with_mixed(p: Pass, num_decodes: int, padding: int) -> Pass:
    """The pass with its first num_decodes sequences handed over as a decode batch: as an eager pass does
    (padding 0), or as a prefill graph's decode slots do (`padding` slots of length 0 after them)."""
    m, d = p.meta, num_decodes
    dev, width = m.seq_lens.device, m.block_tables.shape[1]
    slots = d + padding
    decodes = AttentionMetadata(
        slot_mapping=None,
        query_start_loc=torch.arange(slots + 1, dtype=torch.int32, device=dev).clamp(max=d),
        seq_lens=torch.cat([m.seq_lens[:d], torch.zeros(padding, dtype=torch.int32, device=dev)]),
        block_tables=torch.cat([m.block_tables[:d], torch.zeros(padding, width, dtype=torch.int32, device=dev)]),
        query_lens=[1] * slots,
        seq_lens_cpu=m.seq_lens_cpu[:d] + [0] * padding,
        block_size=m.block_size,
    )
    chunks = AttentionMetadata(
        slot_mapping=None,
        query_start_loc=m.query_start_loc[d:],  # rows of the whole pass
        seq_lens=m.seq_lens[d:],
        block_tables=m.block_tables[d:],
        query_lens=m.query_lens[d:],
        seq_lens_cpu=m.seq_lens_cpu[d:],
        block_size=m.block_size,
    )
    return p._replace(meta=AttentionMetadata(**{**vars(m), "mixed": MixedSplit(decodes, chunks), "plan": None}))


@contextlib.contextmanager
def decode_kernel_batches() -> Iterator[list[int]]:
    """The batch size of every call the Triton backend makes to the decode kernel inside the block."""
    from pdserve.kernels import triton_backend

    batches: list[int] = []
    kernel = triton_backend.paged_decode_attention

    def counted(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        batches.append(q.shape[0])
        return kernel(q, *args, **kwargs)

    triton_backend.paged_decode_attention = counted  # type: ignore[assignment]
    try:
        yield batches
    finally:
        triton_backend.paged_decode_attention = kernel


def run_backend(backend: object, p: Pass, tables: RopeTables, rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention output, cache after the append) of one backend on a copy of the pass's cache."""
    meta = AttentionMetadata(**{**vars(p.meta), "plan": None})
    cache = p.cache.clone()
    backend.prepare(meta)  # type: ignore[attr-defined]
    rope = Rope(p.positions, tables)
    scale = p.q.shape[2] ** -0.5
    if rows:
        assert meta.rows is not None
        out = backend.forward_rows(p.q[meta.rows.index], p.k, p.v, cache, meta, scale, rope)  # type: ignore[attr-defined]
    else:
        out = backend.forward(p.q, p.k, p.v, cache, meta, scale, rope)  # type: ignore[attr-defined]
    return out, cache


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def check_backends(dtype: torch.dtype, dims: tuple[int, int, int, int], device: str, seed: int) -> None:
    """Triton backend == torch backend with rope: prefill, decode, last-layer rows and mixed passes (the decodes
    split off, as an eager pass or a prefill graph hands them over)."""
    from pdserve.kernels.triton_backend import TritonAttention

    tables = rope_tables(dims[2], 8192, device)
    prefill = make_pass([(0, 37), (40, 1), (16, 20), (5, 3)], dims, dtype, device, seed)
    decode = make_pass([(0, 1), (17, 1), (63, 1)], dims, dtype, device, seed + 1, decode=True)
    mixed = make_pass([(40, 1), (17, 1), (63, 1), (0, 37), (16, 20)], dims, dtype, device, seed + 2)
    passes = {
        "prefill": (prefill, False, []),
        "decode": (decode, False, [3]),
        "rows": (with_rows(prefill, [0, 2, 3]), True, [3]),
        "mixed": (with_mixed(mixed, 3, padding=0), False, [3]),
        "mixed, graph slots": (with_mixed(mixed, 3, padding=2), False, [5]),  # zero rows 3-4, then the chunk's
    }
    for name, (p, rows, decode_batches) in passes.items():
        with decode_kernel_batches() as batches:
            out, cache = run_backend(TritonAttention(max_batch=8), p, tables, rows)
        assert batches == decode_batches, f"{name}: decode kernel batches {batches}"
        want, want_cache = run_backend(TorchAttention(), p, tables, rows)
        # K rotated in the append rounds as torch does: the caches are equal
        assert torch.equal(cache, want_cache), f"{name}: the caches differ"
        err = relative_error(out, want)
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.3g}"


DIMS = [(8, 2, 64, 16), (32, 8, 64, 16), (16, 2, 128, 32), (4, 4, 32, 8)]  # heads, kv_heads, head_dim, block_size


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("dims", DIMS, ids=[f"{h}h{kv}kv{d}d{b}b" for h, kv, d, b in DIMS])
def test_triton_backend_rope_equals_torch_backend_on_gpu(
    dtype: torch.dtype, dims: tuple[int, int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    check_backends(dtype, dims, "cuda", seed=sum(dims))


@pytest.mark.gpu
def test_rope_tables_in_the_model_dtype_give_the_same_result_on_gpu() -> None:
    """A model cast whole to bf16 holds its tables in bf16: the kernels cast them to q's dtype first anyway."""
    from pdserve.kernels.triton_backend import TritonAttention

    p = make_pass([(0, 50), (9, 4)], (8, 2, 64, 16), torch.bfloat16, "cuda", seed=3)
    tables = rope_tables(64, 4096, "cuda")
    out, cache = run_backend(TritonAttention(), p, tables, rows=False)
    out16, cache16 = run_backend(TritonAttention(), p, RopeTables(*(t.bfloat16() for t in tables)), rows=False)
    assert torch.equal(out, out16) and torch.equal(cache, cache16)


def test_torch_rope_equals_transformers() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(9, 4, 16, generator=gen).to(dtype)  # [tokens, heads, head_dim]
        k = torch.randn(9, 2, 16, generator=gen).to(dtype)
        positions = torch.tensor([0, 1, 2, 700, 5, 1023, 9, 10, 11])
        tables = rope_tables(16, 1024, "cpu", theta=10000.0)
        cos, sin = (t[positions].to(dtype)[None] for t in tables)  # [1, tokens, head_dim], as transformers casts
        q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        assert torch.equal(rope_ref_one(positions, q, tables), q_hf[0].transpose(0, 1))
        assert torch.equal(rope_ref_one(positions, k, tables), k_hf[0].transpose(0, 1))


def _interpreter_checks() -> None:
    check_backends(torch.float32, (4, 2, 16, 4), "cpu", seed=1)
    check_backends(torch.float32, (6, 3, 32, 8), "cpu", seed=2)
    check_backends(torch.float16, (4, 1, 16, 16), "cpu", seed=3)
    print("interpreter checks passed")


@pytest.mark.slow
def test_backends_match_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = child_env(TRITON_INTERPRET="1")
    code = "from tests.kernels.test_rope_tiles import _interpreter_checks; _interpreter_checks()"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "interpreter checks passed" in run.stdout
