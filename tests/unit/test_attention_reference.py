"""The torch reference backend against dense causal attention, on shuffled paged layouts."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.attention import AttentionMetadata, TorchAttention


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float) -> torch.Tensor:
    """q [n, H, D] at positions num_cached.., k/v [num_cached + n, Hkv, D] -> [n, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(q.shape[0])[:, None] + num_cached
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_equals_dense(heads: int, kv_heads: int, block_size: int) -> None:
    torch.manual_seed(heads * 100 + block_size)
    dim, num_blocks = 8, 64
    cases = [(0, 5), (7, 1), (3, 9), (16, 1), (0, 1), (block_size * 2, 3)]  # (cached tokens, new tokens)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, dim)
    free = torch.randperm(num_blocks - 1).add(1).tolist()  # shuffled, never the null block
    tables, full_k, full_v, slots, qs = [], [], [], [], []
    for cached, new in cases:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(blocks)
        k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
        full_k.append(k)
        full_v.append(v)
        seq_slots = [blocks[p // block_size] * block_size + p % block_size for p in range(total)]
        flat = cache.view(2, -1, kv_heads, dim)
        flat[0, seq_slots[:cached]], flat[1, seq_slots[:cached]] = k[:cached], v[:cached]
        slots.extend(seq_slots[cached:])
        qs.append(torch.randn(new, heads, dim))
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, *torch.tensor([n for _, n in cases]).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in cases], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens=[n for _, n in cases],
        seq_lens_cpu=[c + n for c, n in cases],
        block_size=block_size,
    )
    backend = TorchAttention()
    backend.prepare(meta)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, cases, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, cases, strict=True)])
    out = backend.forward(torch.cat(qs), new_k, new_v, cache, meta, scale=dim**-0.5)
    expected = torch.cat(
        [dense_attention(q, k, v, c, dim**-0.5) for q, k, v, (c, _) in zip(qs, full_k, full_v, cases, strict=True)]
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache[:, 0], torch.zeros_like(cache[:, 0]))  # the null block is never written
