"""Each token's position and KV slot, computed from a pass's per-sequence metadata.

The host builds them with numpy for an eager pass (`token_positions_slots`); a graphed prefill pass runs
`fill_positions_slots` inside its graph instead, so the host uploads only token ids and the per-sequence
metadata (a 4000-token pass: ~0.1 ms of host time on an H200 host, before the first kernel).

Contract (both): token t of sequence i (query_start[i] <= t < query_start[i + 1]) sits at position
seq_lens[i] - query_len[i] + (t - query_start[i]) and its K/V goes to slot
block_tables[i, pos // block_size] * block_size + pos % block_size. Tokens past the last sequence's end
(graph padding) get position 0 and slot 0 (the null block).
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without the `gpu` extra
    triton = None  # type: ignore[assignment]

TILE = 1024
"""Tokens per program."""


def token_positions_slots(
    query_start: np.ndarray,  # [num_seqs + 1] cumulative query lengths
    seq_lens: np.ndarray,  # [num_seqs] tokens of each sequence after the pass
    tables: np.ndarray,  # [num_seqs, width] int32 block tables
    block_size: int,
) -> tuple[np.ndarray, np.ndarray]:  # positions [num_tokens] int64, slots [num_tokens] int64
    """The host's version (numpy), for the pass's real tokens."""
    starts = np.asarray(query_start, np.int64)
    q_lens = np.diff(starts)
    seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)  # [num_tokens]
    pos = np.arange(int(starts[-1])) + (np.asarray(seq_lens, np.int64) - q_lens - starts[:-1])[seq_of_token]
    block_of_token, offset = np.divmod(pos, block_size)
    # NOTE: a flat take, not 2-D fancy indexing (4000 tokens: 2.5x)
    slots = tables.ravel().astype(np.int64)[seq_of_token * tables.shape[1] + block_of_token] * block_size + offset
    return pos, slots


if triton is not None:

    @triton.jit(do_not_specialize=["num_tokens"])
    def _positions_slots_kernel(
        query_start_ptr,  # [NUM_SEQS + 1] int32
        seq_lens_ptr,  # [NUM_SEQS] int32
        tables_ptr,  # [NUM_SEQS, width] int32
        positions_ptr,  # [num_tokens] int64
        slots_ptr,  # [num_tokens] int64
        num_tokens,
        stride_bt,
        NUM_SEQS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
    ):
        t = tl.program_id(0) * TILE + tl.arange(0, TILE)
        seq = tl.zeros([TILE], dtype=tl.int32)  # sequences that end at or before t: t's sequence
        for i in tl.static_range(1, NUM_SEQS + 1):
            seq += (t >= tl.load(query_start_ptr + i)).to(tl.int32)
        real = seq < NUM_SEQS
        seq = tl.minimum(seq, NUM_SEQS - 1)
        q_begin = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_begin
        pos = tl.where(real, tl.load(seq_lens_ptr + seq) - q_len + (t - q_begin), 0)
        block = tl.load(tables_ptr + seq.to(tl.int64) * stride_bt + pos // BLOCK_SIZE, mask=real, other=0)
        slot = tl.where(real, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, 0)
        in_range = t < num_tokens
        tl.store(positions_ptr + t, pos.to(tl.int64), mask=in_range)
        tl.store(slots_ptr + t, slot, mask=in_range)


def fill_positions_slots(
    query_start: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    tables: torch.Tensor,  # [num_seqs, width] int32
    positions: torch.Tensor,  # [num_tokens] int64, written
    slots: torch.Tensor,  # [num_tokens] int64, written
    block_size: int,
) -> None:
    """The device's version (Triton, CUDA tensors), padding tokens included; no host sync, graph-safe."""
    num_seqs, num_tokens = seq_lens.shape[0], positions.shape[0]
    assert query_start.shape == (num_seqs + 1,) and tables.shape[0] == num_seqs and slots.shape == positions.shape
    assert positions.dtype == slots.dtype == torch.int64 and tables.dtype == torch.int32 and tables.stride(1) == 1
    _positions_slots_kernel[(triton.cdiv(num_tokens, TILE),)](
        query_start, seq_lens, tables, positions, slots, num_tokens, tables.stride(0),
        NUM_SEQS=num_seqs, BLOCK_SIZE=block_size, TILE=TILE,
    )  # fmt: skip
