"""The prefill attention kernel against its torch reference: small fp32 cases on CPU under the Triton
interpreter (in a subprocess, since the interpreter flag must be set before triton is imported), and the
real kernel on CUDA over odd lengths, cached prefixes, GQA ratios, block sizes, dtypes and long contexts,
through TMA descriptors (16-bit types on Hopper) and pointer loads.

Caches and outputs start as NaN: a read of an unwritten slot or a row left unwritten shows up as NaN. The
kernel reads new tokens' K/V from k_new/v_new, so it runs on a copy of the cache whose new-token slots are NaN
too (the reference reads everything from the cache).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")

from pdserve.kernels.attention import AttentionMetadata, TorchAttention
from pdserve.kernels.prefill_attention import (
    choose_tile_config,
    launch_prefill_kernel,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    tma_supported,
)
from pdserve.kernels.prefill_splits import PrefillWorkspace
from pdserve.kernels.split_policy import NUM_SPLITS, SPLIT_MAX_TOKENS, SPLIT_MIN_PREFIX, choose_num_splits

REPO_ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
"""Bound on ||out - ref|| / ||ref||; fp32 runs IEEE dots and is compared with an fp64 reference."""


class PagedBatch(NamedTuple):
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_new: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], the new tokens' K (also in kv_cache)
    v_new: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim], NaN outside the sequences
    block_tables: torch.Tensor  # [batch, max_blocks] int32, shuffled blocks, padded with 0
    query_start_loc: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32
    query_lens: list[int]
    new_slots: torch.Tensor  # [num_tokens] int64, the cache slot of each new token

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    def cache_without_new_tokens(self) -> torch.Tensor:
        """A copy of kv_cache with the new tokens' slots poisoned: what the kernel may read of the cache."""
        cache = self.kv_cache.clone()
        flat = cache.view(2, -1, *cache.shape[3:])  # [2, num_blocks * block_size, kv_heads, head_dim]
        flat[:, self.new_slots] = math.nan
        return cache


class CpuCase(NamedTuple):
    query_lens: list[int]
    prefix_lens: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


CPU_CASES = [
    CpuCase([5, 1, 0, 19], [3, 10, 4, 0], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4),
    CpuCase([33, 7, 1], [0, 21, 40], num_heads=8, num_kv_heads=2, head_dim=32, block_size=16),
    CpuCase([70, 2], [9, 0], num_heads=4, num_kv_heads=1, head_dim=16, block_size=4),  # two query tiles
    CpuCase([9, 3, 4, 5], [30, 31, 32, 62], num_heads=2, num_kv_heads=2, head_dim=16, block_size=8),
    CpuCase([40, 1, 77], [70, 130, 64], num_heads=4, num_kv_heads=1, head_dim=16, block_size=64),
    CpuCase([3, 17, 1], [600, 333, 95], num_heads=4, num_kv_heads=1, head_dim=16, block_size=16),  # 7, 4, 1 splits
]
"""Small fp32 cases for the interpreter: GQA 1, 2 and 4, block sizes from 4 to 64 (above the 32-key tile),
prefixes (some ending next to a tile boundary), query lengths 1, 0 and odd; each runs split (a pass of few
tokens: prefixes of 2+ split ranges, kernels/prefill_splits.py) and unsplit."""


def make_batch(
    query_lens: list[int],
    prefix_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    poison: bool = True,
    key_ramp: float = 0.0,
) -> PagedBatch:
    """Random q and K/V for sequences of prefix + query tokens, on shuffled blocks (never the null block); keys
    at position p scaled by 1 + key_ramp * p."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    num_seq_blocks = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max(num_seq_blocks, default=0) + 1  # a padding column on every row
    num_blocks = 1 + sum(num_seq_blocks) + 2
    block_ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(shape, math.nan) if poison else torch.zeros(shape)
    used, new_slots = 0, []
    for i, (seq_len, n) in enumerate(zip(seq_lens, num_seq_blocks, strict=True)):
        tables[i, :n] = block_ids[used : used + n].int()
        used += n
        pos = torch.arange(seq_len)
        kv = torch.randn(2, seq_len, num_kv_heads, head_dim, generator=gen)
        kv[0] *= (1 + key_ramp * pos)[:, None, None]
        kv_cache[:, tables[i, pos // block_size].long(), pos % block_size] = kv
        new_pos = pos[prefix_lens[i] :]
        new_slots.append(tables[i, new_pos // block_size].long() * block_size + new_pos % block_size)
    slots = torch.cat(new_slots) if new_slots else torch.zeros(0, dtype=torch.int64)
    new_kv = kv_cache.view(2, -1, num_kv_heads, head_dim)[:, slots]  # [2, num_tokens, kv_heads, head_dim]
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(query_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        q.to(device, dtype),
        new_kv[0].to(device, dtype),
        new_kv[1].to(device, dtype),
        kv_cache.to(device, dtype),
        tables.to(device),
        starts.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        list(query_lens),
        slots.to(device),
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def run_kernel(
    batch: PagedBatch,
    scale: float,
    q: torch.Tensor | None = None,
    tma: bool | None = None,
    num_splits: int = 1,
) -> torch.Tensor:
    """The kernel over the cache without the new tokens' K/V; tma=None lets paged_prefill_attention choose."""
    q = batch.q if q is None else q
    out = torch.full_like(q, math.nan)
    args = (batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.max_query_len, scale, out)
    cache = batch.cache_without_new_tokens()
    if tma is None:
        paged_prefill_attention(q, batch.k_new, batch.v_new, cache, *args, num_splits=num_splits)
    elif batch.max_query_len > 0:
        cfg = choose_tile_config(q.shape[2], q.dtype, batch.max_query_len)
        workspace = PrefillWorkspace.allocate(q.shape[0], q.shape[1], q.shape[2], q.device)
        launch_prefill_kernel(q, batch.k_new, batch.v_new, cache, *args, cfg, tma, num_splits, workspace)
    return out


def reference(batch: PagedBatch, scale: float) -> torch.Tensor:
    """fp64 reference for fp32 inputs, the fp32 reference otherwise."""
    wide = batch.q.dtype == torch.float32
    q = batch.q.double() if wide else batch.q
    kv_cache = batch.kv_cache.double() if wide else batch.kv_cache
    return paged_prefill_attention_ref(q, kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, scale)


def assert_matches_reference(
    batch: PagedBatch, q: torch.Tensor | None = None, tma: bool | None = None, num_splits: int = 1
) -> None:
    scale = batch.q.shape[2] ** -0.5
    out = run_kernel(batch, scale, q, tma, num_splits)
    assert not out.isnan().any(), "some output element was not written (or read an unwritten cache slot)"
    err = relative_error(out, reference(batch, scale))
    assert err < TOLERANCE[batch.q.dtype], f"relative error {err:.3g}"


def check_cpu_cases() -> None:
    """Entry point of the interpreter subprocess; an AssertionError makes it exit non-zero."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for i, case in enumerate(CPU_CASES):
        batch = make_batch(*case, dtype=torch.float32, device="cpu", seed=i)
        assert_matches_reference(batch, num_splits=NUM_SPLITS)
        assert_matches_reference(batch)
    # scores that grow along the keys by far more than fp32's exp2 range (2^128): a kernel that did not rescale its
    # accumulator as a row's max grows would overflow (checked: one that rescales only on its first tile fails)
    for i, case in enumerate(CPU_CASES[:3]):
        batch = make_batch(*case, dtype=torch.float32, device="cpu", seed=20 + i, key_ramp=2.0)
        batch = batch._replace(q=batch.q * 4)
        assert_matches_reference(batch, num_splits=NUM_SPLITS)
        assert_matches_reference(batch)
    # q as a strided view of a fused qkv projection, as the model hands it over
    case = CPU_CASES[1]
    batch = make_batch(*case, dtype=torch.float32, device="cpu", seed=7)
    num_tokens, num_heads, head_dim = batch.q.shape
    qkv = torch.randn(num_tokens, (num_heads + 2 * case.num_kv_heads) * head_dim)
    q_view = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    q_view.copy_(batch.q)
    assert_matches_reference(batch, q_view)


@pytest.mark.slow
def test_kernel_matches_reference_under_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.kernels.test_prefill_attention import check_cpu_cases; check_cpu_cases()"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("head_dim", [8, 48, 512])
def test_rejects_head_dim_outside_powers_of_two_16_to_256(head_dim: int) -> None:
    batch = make_batch([3], [0], 2, 1, head_dim, 4, torch.float32, "cpu")
    with pytest.raises(AssertionError, match="head_dim must be a power of two"):
        run_kernel(batch, 1.0)


def test_batch_without_queries_launches_nothing() -> None:
    batch = make_batch([0, 0], [5, 0], 2, 1, 16, 4, torch.float32, "cpu")
    out = run_kernel(batch, 1.0)
    assert out.shape == (0, 2, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (8, 2), (16, 2)])
def test_mixed_batch_with_prefixes_matches_reference_on_gpu(
    dtype: torch.dtype, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int
) -> None:
    query_lens = [1, 7, 17, 63, 129, 1000, 0, 64]
    prefix_lens = [0, 5, 0, 100, 33, 200, 12, 64]
    batch = make_batch(query_lens, prefix_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", seed=1)
    assert_matches_reference(batch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [16, 32, 256])
def test_small_and_large_head_dims_match_reference_on_gpu(dtype: torch.dtype, head_dim: int) -> None:
    batch = make_batch([1, 70, 150], [9, 0, 40], 4, 2, head_dim, 16, dtype, "cuda", seed=10)
    assert_matches_reference(batch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("query_lens", "prefix_lens"),
    [([4100], [0]), ([1500, 1], [3000, 4500]), ([257, 4096], [3900, 1])],
)
def test_long_context_with_cached_prefix_matches_reference_on_gpu(
    dtype: torch.dtype, query_lens: list[int], prefix_lens: list[int]
) -> None:
    batch = make_batch(query_lens, prefix_lens, 8, 2, 128, 16, dtype, "cuda", seed=2)
    assert_matches_reference(batch)


@pytest.mark.gpu
def test_target_prefill_shape_matches_reference_on_gpu() -> None:
    """A 4000-token prompt with 32 heads, 8 KV heads, head_dim 64, bf16, block_size 16."""
    batch = make_batch([4000], [0], 32, 8, 64, 16, torch.bfloat16, "cuda", seed=3)
    assert_matches_reference(batch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_rows_mixed_with_long_prefill_match_reference_on_gpu(dtype: torch.dtype) -> None:
    query_lens = [1] * 6 + [2000] + [1] * 3 + [31]
    prefix_lens = [0, 1, 15, 16, 17, 3000, 48, 1023, 1024, 5, 700]
    batch = make_batch(query_lens, prefix_lens, 16, 4, 64, 16, dtype, "cuda", seed=4)
    assert_matches_reference(batch)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [True, False])
def test_strided_qkv_views_match_reference_on_gpu(tma: bool) -> None:
    """q, K and V as strided views of one fused qkv projection, as the model hands them over."""
    batch = make_batch([300, 1, 45], [20, 77, 0], 8, 2, 64, 16, torch.bfloat16, "cuda", seed=5)
    num_tokens, num_heads, head_dim = batch.q.shape
    qkv = torch.randn(num_tokens, (num_heads + 4) * head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split([num_heads * head_dim, 128, 128], dim=-1))
    for view, values in ((q, batch.q), (k, batch.k_new), (v, batch.v_new)):
        view.copy_(values)
    if tma and not tma_supported(q, k, v):
        pytest.skip("TMA needs a Hopper-class GPU")
    assert_matches_reference(batch._replace(k_new=k, v_new=v), q, tma=tma)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_pointer_path_matches_reference_on_gpu(dtype: torch.dtype, head_dim: int) -> None:
    """The path GPUs without TMA take for 16-bit types (the default elsewhere is covered above)."""
    batch = make_batch([1, 7, 130, 1000, 64], [0, 5, 33, 200, 64], 8, 2, head_dim, 16, dtype, "cuda", seed=11)
    assert_matches_reference(batch, tma=False)


@pytest.mark.gpu
def test_tma_is_the_default_on_hopper_for_16_bit_types() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs a Hopper-class GPU")
    batch = make_batch([10], [0], 4, 2, 64, 16, torch.bfloat16, "cuda")
    assert tma_supported(batch.q, batch.k_new, batch.v_new)
    wide = make_batch([10], [0], 4, 2, 64, 16, torch.float32, "cuda")
    assert not tma_supported(wide.q, wide.k_new, wide.v_new)


def runner_metadata(batch: PagedBatch, prefix_lens: list[int], block_size: int) -> AttentionMetadata:
    """AttentionMetadata as ModelRunner builds it: the new tokens' slots follow their prefixes."""
    tables = batch.block_tables.cpu()
    slots = [
        int(tables[i, p // block_size]) * block_size + p % block_size
        for i, (start, n) in enumerate(zip(prefix_lens, batch.query_lens, strict=True))
        for p in range(start, start + n)
    ]
    device = batch.q.device
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        query_lens=batch.query_lens,
        seq_lens_cpu=batch.seq_lens.tolist(),
        block_size=block_size,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_torch_backend_on_gpu(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    query_lens, prefix_lens, block_size = [37, 1, 200, 5], [0, 63, 16, 300], 16
    batch = make_batch(query_lens, prefix_lens, 8, 2, 64, block_size, dtype, "cuda", seed=6, poison=False)
    meta = runner_metadata(batch, prefix_lens, block_size)
    k, v = torch.randn(2, batch.q.shape[0], 2, 64, device="cuda", dtype=dtype)  # new tokens' K/V
    backend = TorchAttention()
    backend.prepare(meta)
    scale = 64**-0.5
    expected = backend.forward(batch.q, k, v, batch.kv_cache, meta, scale)  # writes k, v into the cache
    out = paged_prefill_attention(
        batch.q, k, v, batch.kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_query_len, scale
    )
    err = relative_error(out, expected)
    assert err < TOLERANCE[dtype], f"relative error {err:.3g}"


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_lengths_on_gpu() -> None:
    """A captured launch reads lengths on the device: replaying it over a re-split batch gives the new answer."""
    first = make_batch([40, 24], [10, 0], 8, 2, 64, 16, torch.bfloat16, "cuda", seed=8)
    second = make_batch([24, 40], [0, 10], 8, 2, 64, 16, torch.bfloat16, "cuda", seed=9)
    assert all(a.shape == b.shape for a, b in zip(first[:7], second[:7], strict=True))
    scale = 64**-0.5
    out = torch.full_like(first.q, math.nan)
    inputs = [t.clone() for t in first[:7]]

    def launch() -> None:
        q, k_new, v_new, kv_cache, tables, starts, seq_lens = inputs
        paged_prefill_attention(q, k_new, v_new, kv_cache, tables, starts, seq_lens, first.max_query_len, scale, out)

    launch()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for buffer, new in zip(inputs, second[:7], strict=True):
        buffer.copy_(new)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    err = relative_error(out, reference(second, scale))
    assert err < TOLERANCE[torch.bfloat16], f"relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("query_lens", "prefix_lens"),
    [([100], [8000]), ([1, 37, 200], [5000, 3000, 64]), ([17, 1, 3, 5], [129, 128, 127, 0]), ([256], [4096])],
)
def test_short_passes_over_long_prefixes_match_reference_split_and_unsplit_on_gpu(
    dtype: torch.dtype, query_lens: list[int], prefix_lens: list[int]
) -> None:
    """Prefix hits and chat turns: few new tokens (a split pass) after long cached prefixes, prefixes of one
    split (under 2 * MIN_SPLIT_TILES tiles) beside ones of many; the same batch unsplit."""
    batch = make_batch(query_lens, prefix_lens, 32, 8, 64, 16, dtype, "cuda", seed=12)
    assert_matches_reference(batch, num_splits=NUM_SPLITS)
    assert_matches_reference(batch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scores_growing_along_the_keys_match_reference_on_gpu(dtype: torch.dtype) -> None:
    """Each row's max keeps growing along the keys (by tens in log2 over a sequence), so the online softmax
    rescales tile after tile; split and unsplit, new keys through TMA and cached prefixes."""
    batch = make_batch([300, 900, 5], [0, 200, 3000], 32, 8, 64, 16, dtype, "cuda", seed=13, key_ramp=0.01)
    batch = batch._replace(q=batch.q * 2)
    assert_matches_reference(batch, num_splits=NUM_SPLITS)
    assert_matches_reference(batch)


def test_passes_split_when_few_tokens_follow_a_long_prefix() -> None:
    assert choose_num_splits(SPLIT_MAX_TOKENS, SPLIT_MIN_PREFIX) == NUM_SPLITS > 1
    assert choose_num_splits(1, 100_000) == NUM_SPLITS
    assert choose_num_splits(SPLIT_MAX_TOKENS + 1, 100_000) == 1  # enough query tiles to fill the GPU
    assert choose_num_splits(104, SPLIT_MIN_PREFIX - 1) == 1  # the surplus programs would cost more than splits save


@pytest.mark.gpu
def test_cuda_graph_of_a_split_pass_follows_new_prefix_lengths_on_gpu() -> None:
    """The split ranges are derived on the device: a captured split pass replayed over other prefix lengths
    (a sequence's split count going from 1 to many and back) gives the new answer."""
    first = make_batch([40, 24], [1000, 0], 8, 2, 64, 16, torch.bfloat16, "cuda", seed=14)
    second = make_batch([24, 40], [0, 1000], 8, 2, 64, 16, torch.bfloat16, "cuda", seed=15)
    assert all(a.shape == b.shape for a, b in zip(first[:7], second[:7], strict=True))
    scale = 64**-0.5
    out = torch.full_like(first.q, math.nan)
    workspace = PrefillWorkspace.allocate(SPLIT_MAX_TOKENS, 8, 64, "cuda")
    inputs = [t.clone() for t in first[:7]]
    inputs[3] = first.cache_without_new_tokens()

    def launch() -> None:
        q, k_new, v_new, kv_cache, tables, starts, seq_lens = inputs
        paged_prefill_attention(
            q, k_new, v_new, kv_cache, tables, starts, seq_lens, 40, scale, out, NUM_SPLITS, workspace
        )  # fmt: skip

    launch()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for batch in (second, first):
        for i, (buffer, new) in enumerate(zip(inputs, batch[:7], strict=True)):
            buffer.copy_(batch.cache_without_new_tokens() if i == 3 else new)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        err = relative_error(out, reference(batch, scale))
        assert err < TOLERANCE[torch.bfloat16], f"relative error {err:.3g}"
