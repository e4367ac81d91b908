"""The Triton attention backend: KV append, paged decode attention and paged prefill attention on CUDA.

A pass whose sequences each bring one new token (decode) runs the split-K decode kernel; any other pass runs
the varlen prefill kernel over cached prefix + new tokens. A mixed pass that says which of its sequences are
decodes (AttentionMetadata.mixed) runs both: the decode kernel on those, then the prefill kernel on the chunks.
Decode reads K/V from the paged cache only, after the append has written the new tokens; prefill reads the
cached prefix from the cache and the new tokens' K/V from the rows the model just computed. With rope, the
append rotates K (into the cache, and a contiguous copy that prefill reads); in prefill it rotates q too (the
prefill kernel loads query tiles through TMA), while the decode kernel rotates its one query per sequence as it
loads it. No rope kernel of its own: one launch per layer fewer, K read once.

NOTE: forward() reads no device value on the host and, after the first decode pass, allocates nothing but
its output, so the model runner can capture decode passes in CUDA graphs. The split-K workspaces are sized
once (decode: max_batch sequences; prefill: SPLIT_MAX_TOKENS tokens) and never reallocated (a captured graph
keeps pointing at them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.kernels.attention import AttentionMetadata, Rope
from pdserve.kernels.decode_attention import MAX_SPLITS, DecodeWorkspace, paged_decode_attention
from pdserve.kernels.kv_append import append_kv
from pdserve.kernels.prefill_attention import paged_prefill_attention
from pdserve.kernels.prefill_splits import PrefillWorkspace
from pdserve.kernels.split_policy import SPLIT_MAX_TOKENS, choose_num_splits
from pdserve.kernels.triton_utils import use_pdl

ROWS_NUM_SPLITS = 8
"""Split-K partitions of forward_rows' decode attention, fixed: a split count picked per pass (from the rows and
the table width) would give the kernels new compile-time variants (split or not, padded split count) mid-serving."""


class _TritonPlan(NamedTuple):
    decode: bool
    """Every sequence has exactly one new token."""
    max_query_len: int
    num_splits: int
    """The prefill kernel's split programs (kernels/prefill_splits.py)."""


class TritonAttention:
    """Implements kernels.attention.AttentionBackend with the Triton kernels of this package."""

    def __init__(self, max_batch: int = 256) -> None:
        self.max_batch = max_batch
        self._workspace: DecodeWorkspace | None = None
        self._prefill_workspace: PrefillWorkspace | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        chunks = meta if meta.mixed is None else meta.mixed.chunks
        decode = meta.mixed is None and meta.max_query_len == 1 and min(meta.query_lens) == 1
        # NOTE: the whole pass's token count: a split's workspace holds its rows, which count the decodes' too
        num_splits = 1 if decode else choose_num_splits(sum(meta.query_lens), chunks.max_prefix_len)
        meta.plan = _TritonPlan(decode, chunks.max_query_len, num_splits)

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
        plan: _TritonPlan = meta.plan
        tables = rope.tables if rope is not None else None
        positions = rope.positions if rope is not None else None
        pdl = use_pdl(q)
        if plan.decode:  # the decode kernel rotates each sequence's one query as it loads it
            self._append(k, v, kv_cache, meta, rope, pdl)
            workspace = self._decode_workspace(q)
            return paged_decode_attention(
                q, kv_cache, meta.block_tables, meta.seq_lens, scale, workspace=workspace, rope=tables, pdl=pdl
            )
        assert meta.slot_mapping is not None, "a prefill pass needs slot_mapping"
        k, q_rot = append_kv(k, v, kv_cache, meta.slot_mapping, positions, rope=tables, q=q if rope else None, pdl=pdl)
        q = q if q_rot is None else q_rot
        chunks, out = meta, None
        if meta.mixed is not None:  # the decodes first: their padding slots' zero rows are the chunks' to overwrite
            decodes, chunks = meta.mixed
            out = torch.empty_like(q)
            rows = slice(0, decodes.num_seqs)
            paged_decode_attention(
                q[rows], kv_cache, decodes.block_tables, decodes.seq_lens, scale, out=out[rows],
                num_splits=ROWS_NUM_SPLITS, workspace=self._decode_workspace(q[rows]), pdl=pdl,
            )  # fmt: skip
        return paged_prefill_attention(
            q, k, v, kv_cache, chunks.block_tables, chunks.query_start_loc, chunks.seq_lens, plan.max_query_len,
            scale, out=out, num_splits=plan.num_splits, workspace=self._prefill_split_workspace(q),
        )  # fmt: skip

    def forward_rows(
        self,
        q: torch.Tensor,  # [num_rows, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        rope: Rope | None = None,
    ) -> torch.Tensor:  # [num_rows, num_heads, head_dim]
        """Every new token's K/V into the cache, then the rows' attention as a decode pass over the cache."""
        assert meta.rows is not None and meta.slot_mapping is not None, "forward_rows needs a prefill pass's rows"
        tables = rope.tables if rope is not None else None
        pdl = use_pdl(q)
        self._append(k, v, kv_cache, meta, rope, pdl)
        rows = meta.rows.meta
        if not len(q):
            return q
        workspace = self._decode_workspace(q)
        return paged_decode_attention(
            q, kv_cache, rows.block_tables, rows.seq_lens, scale, num_splits=ROWS_NUM_SPLITS, workspace=workspace,
            rope=tables, pdl=pdl,
        )  # fmt: skip

    @staticmethod
    def _append(
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rope: Rope | None,
        pdl: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tables = rope.tables if rope is not None else None
        positions = rope.positions if rope is not None else None
        if meta.slot_mapping is not None:
            return append_kv(k, v, kv_cache, meta.slot_mapping, positions, rope=tables, pdl=pdl)
        return append_kv(k, v, kv_cache, positions=meta.positions, block_tables=meta.block_tables, rope=tables, pdl=pdl)

    def _prefill_split_workspace(self, q: torch.Tensor) -> PrefillWorkspace:
        """Sized once for SPLIT_MAX_TOKENS tokens (a captured prefill graph keeps pointing at it)."""
        ws = self._prefill_workspace
        if ws is None or ws.partial_out.shape[2:] != q.shape[1:]:
            ws = self._prefill_workspace = PrefillWorkspace.allocate(SPLIT_MAX_TOKENS, q.shape[1], q.shape[2], q.device)
        return ws

    def _decode_workspace(self, q: torch.Tensor) -> DecodeWorkspace:
        batch, num_heads, head_dim = q.shape
        ws = self._workspace
        if ws is None or ws.partial_out.shape[1:] != (num_heads, MAX_SPLITS, head_dim):
            rows = max(self.max_batch, batch)
            ws = self._workspace = DecodeWorkspace.allocate(rows, num_heads, head_dim, MAX_SPLITS, q.device)
        if ws.partial_out.shape[0] < batch:
            raise ValueError(f"decode batch {batch} exceeds the backend's max_batch {self.max_batch}")
        return ws
