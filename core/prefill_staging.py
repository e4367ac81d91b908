"""The host side of a graphed prefill pass: one pinned buffer holding a pass's inputs in fixed slots.

A graph replays on fixed addresses, so a pass is written into a fixed layout: `decode_slots` sequence slots for
the pass's leading one-token sequences (a decode worker's decodes, which its attention runs as a decode batch:
kernels/attention.py MixedSplit), then PREFILL_GRAPH_SEQS slots for its prefill chunks, then one logits row per
slot. Unused slots are padding: query length 0 (their query_start repeats the previous end) and seq_len 0.

int64 part: ids [max_tokens], logits_idx [num_slots].
int32 part: query_start [num_slots + 1], seq_lens [num_slots], tables [num_slots, width], then the logits rows'
query_start [num_slots + 1] (0, 1, 2, ...: one query each), seq_lens [num_slots], tables [num_slots, width].
Every array starts 16 bytes aligned.
"""

from __future__ import annotations

from typing import Generic, NamedTuple, TypeVar

import numpy as np
import torch

from pdserve.kernels.attention import num_leading_decodes

PREFILL_GRAPH_SEQS = 8
"""Prefill chunks a graphed pass holds at most; a pass of more runs eagerly."""


class HostInputs(NamedTuple):
    """One general pass's flat inputs, built on the host (ModelRunner._host_inputs)."""

    ids: np.ndarray  # [num_tokens] int64
    logits_idx: np.ndarray  # [num_sampling] int64
    query_start: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    tables: np.ndarray  # [num_seqs, num_table_blocks] int32
    row_seqs: np.ndarray  # [num_sampling] int64: the sequence of each logits row (see OutputRows)


A = TypeVar("A", np.ndarray, torch.Tensor)


class StagedArrays(NamedTuple, Generic[A]):
    """The layout's arrays over one buffer: numpy views of the host's, or torch views of the device's copy."""

    ids: A
    logits_idx: A
    query_start: A
    seq_lens: A
    tables: A  # [num_slots, width]
    row_query_start: A
    row_seq_lens: A
    row_tables: A  # [num_slots, width]


def _aligned(n: int, itemsize: int) -> int:
    """Elements of a part of n elements rounded up to a whole number of 16 bytes."""
    step = 16 // itemsize
    return -(-n // step) * step


class PrefillStaging:
    """The pinned host buffer of a graphed pass, and its layout."""

    def __init__(self, max_tokens: int, decode_slots: int, max_blocks: int, pin: bool = True) -> None:
        self.max_tokens, self.decode_slots, self.width = max_tokens, decode_slots, max_blocks
        self.num_slots = s = decode_slots + PREFILL_GRAPH_SEQS
        self._longs = [max_tokens, s]
        self._ints = [s + 1, s, s * max_blocks] * 2
        longs_bytes = sum(_aligned(n, 8) for n in self._longs) * 8
        ints_bytes = sum(_aligned(n, 4) for n in self._ints) * 4
        self.nbytes = longs_bytes + ints_bytes
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host = StagedArrays(*(v.numpy() for v in self.arrays(self.buffer)))
        self.host.row_query_start[:] = np.arange(s + 1)  # NOTE: constant, one query per row

    def arrays(self, buffer: torch.Tensor) -> StagedArrays[torch.Tensor]:
        """The layout's arrays as views of `buffer`: this staging's, or its copy on the device."""
        views: list[torch.Tensor] = []
        at = 0
        for dtype, sizes in ((torch.int64, self._longs), (torch.int32, self._ints)):
            itemsize = dtype.itemsize
            for n in sizes:
                views.append(buffer[at : at + n * itemsize].view(dtype))
                at += _aligned(n, itemsize) * itemsize
        s, w = self.num_slots, self.width
        views[4], views[7] = views[4].view(s, w), views[7].view(s, w)
        return StagedArrays(*views)

    def num_decodes(self, host: HostInputs) -> int:
        """The pass's leading one-token sequences that go to decode slots (0 without decode slots)."""
        if not self.decode_slots:
            return 0
        return num_leading_decodes(np.diff(host.query_start).tolist())

    def fits(self, host: HostInputs, num_decodes: int) -> bool:
        num_chunks = len(host.seq_lens) - num_decodes
        return (
            len(host.ids) <= self.max_tokens
            and num_decodes <= self.decode_slots
            and num_chunks <= PREFILL_GRAPH_SEQS
            and host.tables.shape[1] <= self.width
        )

    def load(self, host: HostInputs, size: int, num_decodes: int) -> None:
        """Write a pass (fits() holds) of `size` graph tokens: its first num_decodes sequences into decode slots,
        the rest into chunk slots, padding everything else."""
        a, d, dslots = self.host, num_decodes, self.decode_slots
        n, c, r = len(host.ids), len(host.seq_lens) - d, len(host.row_seqs)
        a.ids[:n] = host.ids
        a.ids[n:size] = 0  # NOTE: padding tokens: id 0 at position 0, K/V into the null block
        a.logits_idx[:r] = host.logits_idx
        a.logits_idx[r:] = 0
        qs = a.query_start
        qs[:d] = host.query_start[:d]
        qs[d:dslots] = d
        qs[dslots : dslots + c + 1] = host.query_start[d:]
        qs[dslots + c + 1 :] = n
        s = self.num_slots
        _write(a.seq_lens, a.tables, host.seq_lens[:d], host.tables[:d], 0, dslots)
        _write(a.seq_lens, a.tables, host.seq_lens[d:], host.tables[d:], dslots, s)
        if r == d + c:  # NOTE: every sequence samples: the rows are the sequences, in order (no gather)
            _write(a.row_seq_lens, a.row_tables, host.seq_lens, host.tables, 0, s)
        else:
            _write(a.row_seq_lens, a.row_tables, host.seq_lens[host.row_seqs], host.tables[host.row_seqs], 0, s)


def _write(
    lens: np.ndarray, tables: np.ndarray, src_lens: np.ndarray, src_tables: np.ndarray, start: int, stop: int
) -> None:
    """src's sequences into slots [start, start + len(src_lens)); the slots from there to stop become padding."""
    end = start + len(src_lens)
    lens[start:end] = src_lens
    lens[end:stop] = 0
    tables[start:end, : src_tables.shape[1]] = src_tables
    tables[end:stop, 0] = 0
