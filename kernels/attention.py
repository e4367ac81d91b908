"""The attention-backend interface over a paged KV cache, and its torch reference implementation.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim]; index 0 holds K, 1 holds V.
A token at position p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size.
Block 0 is the null block: padding rows of block tables point at it and it is never read unmasked.

One forward pass carries a flat batch of new tokens from several sequences (prefill chunks and decodes mixed):
sequence i owns queries query_start_loc[i]:query_start_loc[i+1]; they sit at the last query_len positions of
its seq_lens[i] tokens, and attend causally to everything before them (cached prefix included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from pdserve.kernels.rope_tiles import RopeTables, rope_ref_one


@dataclass
class AttentionMetadata:
    """One forward pass's view of the paged cache, shared by every layer."""

    slot_mapping: torch.Tensor | None
    """[num_tokens] int64: cache slot each new token's K/V is written to. None on a decode pass built from
    persistent buffers: there each sequence has one new token at `positions`, found through block_tables."""
    query_start_loc: torch.Tensor
    """[batch + 1] int32: cumulative query lengths."""
    seq_lens: torch.Tensor
    """[batch] int32: tokens of each sequence after this pass (cached + new)."""
    block_tables: torch.Tensor
    """[batch, max_blocks] int32, padded with the null block 0."""
    query_lens: list[int]
    """Host copy of the per-sequence query lengths."""
    seq_lens_cpu: list[int]
    """Host copy of seq_lens."""
    block_size: int
    """Tokens per block."""
    positions: torch.Tensor | None = None
    """[num_tokens] int64 positions of the new tokens; required when slot_mapping is None."""
    rows: OutputRows | None = None
    """The only tokens the pass needs out of its last layer (its sampling rows); None: every token."""
    mixed: MixedSplit | None = None
    """The pass's leading one-token sequences apart from its prefill chunks; None: not split."""
    plan: Any = field(default=None)
    """Backend-specific precomputation, filled once per pass by AttentionBackend.prepare."""

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu)

    @property
    def max_prefix_len(self) -> int:
        """The most cached tokens any sequence has before its new ones."""
        return max((s - q for s, q in zip(self.seq_lens_cpu, self.query_lens, strict=True)), default=0)


@dataclass
class OutputRows:
    """Tokens of a pass whose last-layer output is needed: the last new token of each sampling sequence.

    A prefill pass samples from one row per prompt, so its last layer needs every token's K/V but the
    attention, MLP and final norm of those rows alone (a 4000-token prompt: 1 row of 4000).
    """

    index: torch.Tensor
    """[num_rows] int64: the rows' places among the pass's new tokens."""
    meta: AttentionMetadata
    """The rows as a decode batch: one query each, at the last of its sequence's seq_lens tokens."""


class MixedSplit(NamedTuple):
    """A pass whose first sequences bring one new token each (decodes) ahead of its prefill chunks.

    A backend may attend the decodes as a decode batch and the chunks alone as a prefill pass, so a decode
    reads its context once instead of being a prefill tile over it. The decodes own the pass's first
    decodes.num_seqs token rows (a graph's slots past its real decodes have seq_len 0: they give zero rows,
    which the chunks' attention, run after them, overwrites); chunks.query_start_loc holds rows of the whole
    pass. Backends that attend every sequence alike (TorchAttention) ignore it.
    """

    decodes: AttentionMetadata
    chunks: AttentionMetadata


class Rope(NamedTuple):
    """Rotate-half rope of a pass's new tokens, which the backend applies to q and k (inside its kernels)."""

    positions: torch.Tensor  # [num_tokens] int64: each new token's position (seq_len - query_len + its row)
    tables: RopeTables


class AttentionBackend(Protocol):
    """Writes new K/V into the paged cache and attends over cached prefix + new tokens.

    Contract: prepare(meta) runs once per forward pass before any layer (meta.rows included); forward(...)
    runs per layer, writes k/v at meta.slot_mapping first, then returns attention for every query token in
    input order. forward_rows(...) is the same for a last layer that needs meta.rows only. Given rope, q and
    k arrive as projected and the backend rotates both (the cache holds rotated K), exactly as
    kernels.rope_tiles.rope_ref_one does.
    """

    def prepare(self, meta: AttentionMetadata) -> None: ...

    def forward_rows(
        self,
        q: torch.Tensor,  # [num_rows, num_heads, head_dim]: the queries of meta.rows alone
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: every new token's
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        rope: Rope | None = None,
    ) -> torch.Tensor:  # [num_rows, num_heads, head_dim]
        ...

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        rope: Rope | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


@dataclass
class _TorchPlan:
    key_slots: torch.Tensor  # [batch, max_seq] int64 flat cache slot of every key position (padding: slot 0)
    query_rows: torch.Tensor  # [num_tokens] int64 row of each query in the padded [batch * max_query] layout
    mask: torch.Tensor  # [batch, 1, max_query, max_seq] bool, True = may attend
    max_query_len: int


class TorchAttention:
    """Reference backend: gathers each sequence's keys and runs SDPA with a causal, padded mask.

    Runs anywhere torch runs; the Triton kernels in kernels/ must match it.
    """

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.rows is not None and meta.rows.meta.num_seqs:
            self.prepare(meta.rows.meta)
        device = meta.block_tables.device
        bs, max_q, max_s = meta.block_size, meta.max_query_len, meta.max_seq_len
        key_pos = torch.arange(max_s, device=device)  # [max_seq]
        blocks = meta.block_tables.long()[:, key_pos // bs]  # [batch, max_seq]
        key_slots = blocks * bs + key_pos % bs
        q_lens = torch.tensor(meta.query_lens, device=device)
        seq_lens = meta.seq_lens.long()
        starts = meta.query_start_loc[:-1].long()
        seq_of_token = torch.repeat_interleave(torch.arange(meta.num_seqs, device=device), q_lens)
        offset = torch.arange(sum(meta.query_lens), device=device) - starts[seq_of_token]
        query_rows = seq_of_token * max_q + offset
        q_idx = torch.arange(max_q, device=device)
        q_pos = (seq_lens - q_lens)[:, None] + q_idx[None, :]  # [batch, max_query]
        mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [batch, max_query, max_seq]
        # NOTE: padded query rows must see at least one key or SDPA returns NaN; their output is dropped.
        mask |= (q_idx[None, :] >= q_lens[:, None])[:, :, None] & (key_pos == 0)[None, None, :]
        meta.plan = _TorchPlan(key_slots, query_rows, mask[:, None], max_q)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        if rope is not None:
            q, k = rope_ref_one(rope.positions, q, rope.tables), rope_ref_one(rope.positions, k, rope.tables)
        self._append(k, v, kv_cache, meta)
        return self._attend(q, kv_cache, meta, scale)

    def forward_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        assert meta.rows is not None, "forward_rows needs a pass with output rows"
        if rope is not None:
            q = rope_ref_one(rope.positions[meta.rows.index], q, rope.tables)
            k = rope_ref_one(rope.positions, k, rope.tables)
        self._append(k, v, kv_cache, meta)
        return self._attend(q, kv_cache, meta.rows.meta, scale) if len(q) else q

    @staticmethod
    def _append(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        slots = meta.slot_mapping if meta.slot_mapping is not None else decode_slots(meta)
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)

    @staticmethod
    def _attend(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention of meta's queries over keys that are all in the cache already."""
        plan: _TorchPlan = meta.plan
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_slots, kv_heads, head_dim]
        v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
        keys = k_flat[plan.key_slots].transpose(1, 2)  # [batch, kv_heads, max_seq, head_dim]
        values = v_flat[plan.key_slots].transpose(1, 2)
        num_heads = q.shape[1]
        q_pad = q.new_zeros(meta.num_seqs * plan.max_query_len, num_heads, head_dim)
        q_pad[plan.query_rows] = q
        q_pad = q_pad.view(meta.num_seqs, plan.max_query_len, num_heads, head_dim).transpose(1, 2)
        if num_heads != num_kv_heads:
            keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
            values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=plan.mask, scale=scale)
        out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [batch * max_query, heads, head_dim]
        return out[plan.query_rows]


def num_leading_decodes(query_lens: Sequence[int]) -> int:
    """Sequences with one new token each at the start of a pass that also has longer ones (else 0)."""
    d = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    return d if d < len(query_lens) else 0


def decode_slots(meta: AttentionMetadata) -> torch.Tensor:  # [batch] int64
    """Slots of a decode pass's new tokens (one per sequence, at meta.positions), from the block tables."""
    assert meta.positions is not None, "a pass without slot_mapping needs positions"
    pos = meta.positions.long()
    blocks = meta.block_tables.long().gather(1, (pos // meta.block_size)[:, None])[:, 0]
    return blocks * meta.block_size + pos % meta.block_size
