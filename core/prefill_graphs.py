"""CUDA graphs of small prefill passes: one graph per token count in a fixed set, padded up to the next size.

A prefill pass of a few hundred tokens is bound by the host: launching ~12 kernels per layer from Python (the
Triton launcher and its wrappers) takes longer than the GPU needs to run them, so a 100-token prompt cost
nearly as much as a 1000-token one. A graph replays the whole pass with one launch.

The sizes captured run up to the first one that holds the scheduler's token budget (max_num_batched_tokens),
so every pass of a default budget (4096) replays a graph: even a 4000-token pass, whose GPU time hides the
launches, spent ~1 ms of its start with the GPU waiting on the host's first kernels.

Inputs live in persistent buffers of the largest size's tokens and PREFILL_GRAPH_SEQS sequences: token ids and
the sequences' metadata come from the host, positions and slots are computed from them inside the graph. Padding
tokens (past the pass's real tokens) have id 0 at position 0 and write their K/V into slot 0 of the null block;
they belong to no sequence (query_start_loc stops at the real tokens), so attention leaves their rows
unwritten and nothing reads them. Padding sequences have query length 0 and seq_len 0.

NOTE: each graph was captured with max_query_len = its token count (the prefill kernel's grid); programs of
rows past a sequence's real length exit at once. Captured largest first, so all share one memory pool. Sizes up
to SPLIT_MAX_TOKENS have a second graph whose prefill attention splits long cached prefixes
(kernels/prefill_splits.py), replayed when the pass has one (choose_num_splits, as an eager pass decides).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from pdserve.core.cuda_graphs import capture
from pdserve.kernels.attention import AttentionBackend, AttentionMetadata, OutputRows
from pdserve.kernels.pass_inputs import fill_positions_slots
from pdserve.kernels.split_policy import SPLIT_MAX_TOKENS, SPLIT_MIN_PREFIX, choose_num_splits

PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 384, *range(512, 2048, 64), *range(2048, 4097, 32))
"""Token counts a graph may be captured at; a pass of more tokens than the largest captured runs eagerly.

NOTE: padding tokens cost GEMM time (H100, 1B Llama shape, one process: 4000 tokens took 16.60 / 16.42 ms on a
4096-token graph, 16.54 / 16.26 on 4032, 16.30 / 16.30 on 4000: ~2 us a padding token), so the steps are 32
tokens from 2048 (at most 1.5% padding) and 64 from 512. The 97 graphs of a 4096-token budget capture in
2.2-3.3 s (30 graphs in steps of 256: 0.7-1.0 s) and take 310 MiB of pool (372 before): all share one memory
pool and one logits buffer, so a graph holds no memory of its own."""
PREFILL_GRAPH_SEQS = 8
"""Sequences a graphed pass holds at most; a pass of more runs eagerly."""

PrefillForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
"""(input_ids [T], positions [T], metadata) -> logits [S, vocab] float32 of the metadata's rows."""


class HostInputs(NamedTuple):
    """One general pass's flat inputs, built on the host (ModelRunner._host_inputs)."""

    ids: np.ndarray  # [num_tokens] int64
    logits_idx: np.ndarray  # [num_sampling] int64
    query_start: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    tables: np.ndarray  # [num_seqs, num_table_blocks] int32
    row_seqs: np.ndarray  # [num_sampling] int64: the sequence of each logits row (see OutputRows)


class PrefillGraphs:
    """Persistent prefill inputs and the graphs captured over them."""

    def __init__(
        self,
        forward: PrefillForward,
        backend: AttentionBackend,
        max_tokens: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.forward, self.backend, self.block_size, self.device = forward, backend, block_size, device
        self.max_blocks = max_blocks
        self.sizes = graph_token_sizes(max_tokens)
        t, s = self.sizes[-1], PREFILL_GRAPH_SEQS
        # int64 [ids; logits_idx], then int32 [query_start; seq_lens; tables] of the sequences and of the logits
        # rows (one row per sequence slot), in one byte buffer: one copy per pass; [positions; slots] are
        # written on the device
        longs_bytes = -(-(t + s) * 8 // 64) * 64  # NOTE: the int32 part starts 64-byte aligned
        ints_bytes = 4 * 2 * (2 * s + 1 + s * max_blocks)
        staging_cpu = torch.zeros(longs_bytes + ints_bytes, dtype=torch.uint8, pin_memory=True)
        self._longs_np = staging_cpu[: (t + s) * 8].view(torch.int64).numpy()  # views of the pinned staging
        self._ints_np = staging_cpu[longs_bytes:].view(torch.int32).numpy()
        self._ints_np[self._rows_at : self._rows_at + s + 1] = np.arange(s + 1)  # NOTE: one query per row
        self.staging_cpu, self.staging = staging_cpu, staging_cpu.to(device)
        self.longs = self.staging[: (t + s) * 8].view(torch.int64)
        self.ints = self.staging[longs_bytes:].view(torch.int32)
        self.token_places = torch.zeros(2, t, dtype=torch.int64, device=device)  # [positions; slots]
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (size, split)
        self._pool = torch.cuda.graph_pool_handle()
        self.logits: torch.Tensor | None = None  # [PREFILL_GRAPH_SEQS, vocab] float32: every graph's output
        self._copied = torch.cuda.Event(external=True)  # recorded by each replay once its copy left the staging

    @property
    def _rows_at(self) -> int:
        """Where the logits rows' part of the int32 buffer starts."""
        return 2 * PREFILL_GRAPH_SEQS + 1 + PREFILL_GRAPH_SEQS * self.max_blocks

    def fits(self, num_tokens: int, num_seqs: int, num_table_blocks: int) -> bool:
        return num_tokens <= self.sizes[-1] and num_seqs <= PREFILL_GRAPH_SEQS and num_table_blocks <= self.max_blocks

    @torch.inference_mode()
    def capture(self) -> None:
        for size in reversed(self.sizes):
            for split in (False, True) if size <= SPLIT_MAX_TOKENS else (False,):
                self._graphs[size, split] = self._capture_one(size, split)

    def _capture_one(self, size: int, split: bool) -> torch.cuda.CUDAGraph:
        """NOTE: the graph copies its logits into the one shared buffer, so its own output is pool memory the
        next capture reuses (a [8, 128256] float32 output each would hold 4 MB per graph)."""
        self._load(_padding_inputs(), size)  # NOTE: all padding: warm-up and capture write only the null block
        self._copy_in()
        args = self._views(size, split)
        self.backend.prepare(args[2])
        # NOTE: every size runs its own eager pass first, though most sizes launch the same kernel variants: a
        # variant compiled inside a capture invalidated it, or (H100, 1B shape) recorded a graph that returned
        # token 0, silently; one pass per kernel set would cut the capture 3.6 -> 1.7 s
        # (bench/results/prefill_graph_capture_dead_end_h100_2026-11-25.json)
        warm = self._forward(*args)  # warm-up: compiles kernels
        if self.logits is None:
            self.logits = torch.empty_like(warm)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, self._pool):
            self._copy_in()
            self.logits.copy_(self._forward(*args))  # [PREFILL_GRAPH_SEQS, vocab]
        return graph

    def _copy_in(self) -> None:
        """The staging's copy to the device, then _copied recorded: the first nodes of every graph.

        NOTE: in the graph, not before its launch: a copy and an event record issued from Python cost ~130 us of
        a cold host's time before the first kernel (H100 host, 4000 tokens); the event is external, so a replay
        records it after its copy and _load waits on that."""
        self.staging.copy_(self.staging_cpu, non_blocking=True)
        self._copied.record()

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert meta.slot_mapping is not None
        fill_positions_slots(
            meta.query_start_loc, meta.seq_lens, meta.block_tables, positions, meta.slot_mapping, self.block_size
        )
        return self.forward(ids, positions, meta)

    def run(self, host: HostInputs) -> torch.Tensor:  # [num_sampling, vocab] float32, a view of the graph's output
        """Load a pass (fits() must hold) and replay the graph of the smallest size that holds it."""
        size = self.sizes[bisect.bisect_left(self.sizes, len(host.ids))]  # NOTE: ~100 sizes: no linear scan
        split = (size, True) in self._graphs and choose_num_splits(len(host.ids), _max_prefix(host)) > 1
        self._load(host, size)
        self._graphs[size, split].replay()
        assert self.logits is not None
        return self.logits[: len(host.logits_idx)]

    def _load(self, host: HostInputs, size: int) -> None:
        """Stage host into the pinned buffers; the graph's first node copies them to the device (_copy_in).

        NOTE: the previous replay's copy must have left the staging before it is rewritten: passes launched
        back to back (a long prompt's chunks, a busy GPU under MPS) would otherwise replay a graph on the next
        pass's inputs.
        """
        self._copied.synchronize()
        t, s, n, b = self.sizes[-1], PREFILL_GRAPH_SEQS, len(host.ids), len(host.seq_lens)
        longs, ints = self._longs_np, self._ints_np
        rows_at, num_rows = self._rows_at, len(host.row_seqs)
        longs[:n] = host.ids
        longs[n:size] = 0
        longs[t : t + num_rows] = host.logits_idx
        longs[t + num_rows : t + s] = 0
        ints[: b + 1] = host.query_start
        ints[b + 1 : s + 1] = n  # padding sequences: query length 0
        self._load_seqs(ints[s + 1 : rows_at], host.seq_lens, host.tables)
        if num_rows == b:  # NOTE: every sequence samples (row_seqs is sorted): the rows' part is the sequences'
            ints[rows_at + s + 1 :] = ints[s + 1 : rows_at]
        else:
            self._load_seqs(ints[rows_at + s + 1 :], host.seq_lens[host.row_seqs], host.tables[host.row_seqs])

    def _load_seqs(self, part: np.ndarray, seq_lens: np.ndarray, tables: np.ndarray) -> None:
        """Write [seq_lens; tables] of PREFILL_GRAPH_SEQS slots; slots past the given sequences get length 0."""
        s, b = PREFILL_GRAPH_SEQS, len(seq_lens)
        part[:b] = seq_lens
        part[b:s] = 0
        table_part = part[s:].reshape(s, self.max_blocks)
        table_part[:b, : tables.shape[1]] = tables
        table_part[b:, 0] = 0

    def _views(self, size: int, split: bool) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        t, s = self.sizes[-1], PREFILL_GRAPH_SEQS
        # NOTE: query_lens and seq_lens_cpu size the kernels' grids (and, as a prefix length, pick a split);
        # real lengths are read on the device
        prefix = SPLIT_MIN_PREFIX if split else 0
        meta = self._meta(self.ints[: self._rows_at], [size] + [0] * (s - 1), self.token_places[1, :size], prefix)
        rows = self._meta(self.ints[self._rows_at :], [1] * s, None)
        meta.rows = OutputRows(self.longs[t : t + s], rows)
        return self.longs[:size], self.token_places[0, :size], meta

    def _meta(
        self, part: torch.Tensor, query_lens: list[int], slots: torch.Tensor | None, prefix: int = 0
    ) -> AttentionMetadata:
        """Metadata over a [query_start; seq_lens; tables] part of the int32 buffer."""
        s = PREFILL_GRAPH_SEQS
        return AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=part[: s + 1],
            seq_lens=part[s + 1 : 2 * s + 1],
            block_tables=part[2 * s + 1 :].view(s, self.max_blocks),
            query_lens=query_lens,
            seq_lens_cpu=[prefix + max(query_lens)] + [0] * (s - 1),
            block_size=self.block_size,
        )


def _max_prefix(host: HostInputs) -> int:
    """The longest cached prefix of the pass's sequences."""
    return int((host.seq_lens - np.diff(host.query_start)).max(initial=0))


def graph_token_sizes(max_tokens: int) -> tuple[int, ...]:
    """The sizes of PREFILL_GRAPH_TOKENS up to the first that holds max_tokens (all of them if none does)."""
    last = next((i for i, size in enumerate(PREFILL_GRAPH_TOKENS) if size >= max_tokens), len(PREFILL_GRAPH_TOKENS) - 1)
    return PREFILL_GRAPH_TOKENS[: last + 1]


def _padding_inputs() -> HostInputs:
    empty = np.zeros(0, dtype=np.int64)
    return HostInputs(empty, empty, np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros((0, 0), np.int32), empty)
