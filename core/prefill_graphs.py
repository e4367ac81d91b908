"""CUDA graphs of small prefill passes: one graph per token count in a fixed set, padded up to the next size.

A prefill pass of a few hundred tokens is bound by the host: launching ~12 kernels per layer from Python (the
Triton launcher and its wrappers) takes longer than the GPU needs to run them, so a 100-token prompt cost
nearly as much as a 1000-token one. A graph replays the whole pass with one launch.

The sizes captured run up to the first one that holds the scheduler's token budget (max_num_batched_tokens),
so every pass of a default budget (4096) replays a graph: even a 4000-token pass, whose GPU time hides the
launches, spent ~1 ms of its start with the GPU waiting on the host's first kernels.

Inputs live in one persistent buffer (core/prefill_staging.py: the largest size's tokens, a decode worker's
decode slots and PREFILL_GRAPH_SEQS chunk slots): token ids and the sequences' metadata come from the host,
positions and slots are computed from them inside the graph. Padding
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

import numpy as np
import torch

from pdserve.core.cuda_graphs import capture
from pdserve.core.prefill_staging import PREFILL_GRAPH_SEQS, HostInputs, PrefillStaging
from pdserve.kernels.attention import AttentionBackend, AttentionMetadata, MixedSplit, OutputRows
from pdserve.kernels.pass_inputs import fill_positions_slots
from pdserve.kernels.split_policy import SPLIT_MAX_TOKENS, SPLIT_MIN_PREFIX, choose_num_splits

PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 384, *range(512, 2048, 64), *range(2048, 4097, 32))
"""Token counts a graph may be captured at; a pass of more tokens than the largest captured runs eagerly.

NOTE: padding tokens cost GEMM time (H100, 1B Llama shape, one process: 4000 tokens took 16.60 / 16.42 ms on a
4096-token graph, 16.54 / 16.26 on 4032, 16.30 / 16.30 on 4000: ~2 us a padding token), so the steps are 32
tokens from 2048 (at most 1.5% padding) and 64 from 512. The 97 graphs of a 4096-token budget capture in
2.2-3.3 s (30 graphs in steps of 256: 0.7-1.0 s) and take 310 MiB of pool (372 before): all share one memory
pool and one logits buffer, so a graph holds no memory of its own."""
PrefillForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
"""(input_ids [T], positions [T], metadata) -> logits [S, vocab] float32 of the metadata's rows."""


class PrefillGraphs:
    """Persistent prefill inputs (core/prefill_staging.py) and the graphs captured over them.

    decode_slots > 0 (a decode worker: max_num_seqs): a pass's leading one-token sequences take decode slots and
    the graph attends them as a decode batch (kernels/attention.py MixedSplit), so a decode worker's pass of a
    prompt chunk beside its running decodes replays a graph however many requests decode. A graph of `size`
    tokens has min(decode_slots, size) of them: a pass never has more decodes than tokens.
    """

    def __init__(
        self,
        forward: PrefillForward,
        backend: AttentionBackend,
        max_tokens: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        decode_slots: int = 0,
    ) -> None:
        self.forward, self.backend, self.block_size, self.device = forward, backend, block_size, device
        self.sizes = graph_token_sizes(max_tokens)
        self.staging = PrefillStaging(self.sizes[-1], decode_slots, max_blocks)
        self.device_buffer = self.staging.buffer.to(device)  # NOTE: [positions; slots] are written on the device
        self.token_places = torch.zeros(2, self.sizes[-1], dtype=torch.int64, device=device)  # [positions; slots]
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (size, split)
        self._pool = torch.cuda.graph_pool_handle()
        self.logits: torch.Tensor | None = None  # [num_slots, vocab] float32: every graph's output
        self._copied = torch.cuda.Event(external=True)  # recorded by each replay once its copy left the staging

    def decodes_if_fits(self, host: HostInputs) -> int | None:
        """The pass's sequences in decode slots if a graph holds the pass, else None (it runs eagerly)."""
        num_decodes = self.staging.num_decodes(host)
        return num_decodes if self.staging.fits(host, num_decodes) else None

    @torch.inference_mode()
    def capture(self) -> None:
        for size in reversed(self.sizes):
            for split in (False, True) if size <= SPLIT_MAX_TOKENS else (False,):
                self._graphs[size, split] = self._capture_one(size, split)

    def _capture_one(self, size: int, split: bool) -> torch.cuda.CUDAGraph:
        """NOTE: the graph copies its logits into the one shared buffer, so its own output is pool memory the
        next capture reuses (a [8, 128256] float32 output each would hold 4 MB per graph)."""
        self._load(_padding_inputs(), size, 0)  # NOTE: all padding: warm-up and capture write only the null block
        self._copy_in()
        args = self._views(size, split)
        self.backend.prepare(args[2])
        # NOTE: every size runs its own eager pass first, though most sizes launch the same kernel variants: a
        # variant compiled inside a capture invalidated it, or (H100, 1B shape) recorded a graph that returned
        # token 0, silently; one pass per kernel set would cut the capture 3.6 -> 1.7 s
        # (bench/results/prefill_graph_capture_dead_end_h100_2026-11-25.json)
        warm = self._forward(*args)  # warm-up: compiles kernels
        if self.logits is None:  # NOTE: the largest graph, captured first, has the most rows
            self.logits = torch.empty_like(warm)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, self._pool):
            self._copy_in()
            self.logits[: len(warm)].copy_(self._forward(*args))
        return graph

    def _copy_in(self) -> None:
        """The staging's copy to the device, then _copied recorded: the first nodes of every graph.

        NOTE: in the graph, not before its launch: a copy and an event record issued from Python cost ~130 us of
        a cold host's time before the first kernel (H100 host, 4000 tokens); the event is external, so a replay
        records it after its copy and _load waits on that."""
        self.device_buffer.copy_(self.staging.buffer, non_blocking=True)
        self._copied.record()

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert meta.slot_mapping is not None
        fill_positions_slots(
            meta.query_start_loc, meta.seq_lens, meta.block_tables, positions, meta.slot_mapping, self.block_size
        )
        return self.forward(ids, positions, meta)

    def run(self, host: HostInputs, num_decodes: int) -> torch.Tensor:  # [num_sampling, vocab] float32
        """Load a pass (num_decodes from decodes_if_fits) and replay the graph of the smallest size that holds it;
        the logits are a view of the graphs' output."""
        size = self.sizes[bisect.bisect_left(self.sizes, len(host.ids))]  # NOTE: ~100 sizes: no linear scan
        split = (size, True) in self._graphs and choose_num_splits(len(host.ids), _max_prefix(host, num_decodes)) > 1
        self._load(host, size, num_decodes)
        self._graphs[size, split].replay()
        assert self.logits is not None
        return self.logits[: len(host.logits_idx)]

    def _load(self, host: HostInputs, size: int, num_decodes: int) -> None:
        """Stage host into the pinned buffer; the graph's first node copies it to the device (_copy_in).

        NOTE: the previous replay's copy must have left the staging before it is rewritten: passes launched
        back to back (a long prompt's chunks, a busy GPU under MPS) would otherwise replay a graph on the next
        pass's inputs.
        """
        self._copied.synchronize()
        self.staging.load(host, size, num_decodes)

    def _views(self, size: int, split: bool) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev, dslots = self.staging.arrays(self.device_buffer), self.staging.decode_slots
        num_decodes = min(dslots, size)
        # NOTE: query_lens and seq_lens_cpu size the kernels' grids (and, as a prefix length, pick a split);
        # real lengths are read on the device
        prefix = SPLIT_MIN_PREFIX if split else 0
        whole = [size] + [0] * (self.staging.num_slots - 1)
        meta = self._meta(dev.query_start, dev.seq_lens, dev.tables, whole, self.token_places[1, :size], prefix)
        if dslots:
            decodes = self._meta(dev.query_start[: num_decodes + 1], dev.seq_lens[:num_decodes],
                                 dev.tables[:num_decodes], [1] * num_decodes, None)  # fmt: skip
            chunks = [size] + [0] * (PREFILL_GRAPH_SEQS - 1)
            at = slice(dslots, None)
            meta.mixed = MixedSplit(
                decodes, self._meta(dev.query_start[at], dev.seq_lens[at], dev.tables[at], chunks, None, prefix)
            )
        rows = num_decodes + PREFILL_GRAPH_SEQS
        row_meta = self._meta(
            dev.row_query_start[: rows + 1], dev.row_seq_lens[:rows], dev.row_tables[:rows], [1] * rows, None
        )
        meta.rows = OutputRows(dev.logits_idx[:rows], row_meta)
        return dev.ids[:size], self.token_places[0, :size], meta

    def _meta(
        self,
        query_start: torch.Tensor,
        seq_lens: torch.Tensor,
        tables: torch.Tensor,
        query_lens: list[int],
        slots: torch.Tensor | None,
        prefix: int = 0,
    ) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=query_start,
            seq_lens=seq_lens,
            block_tables=tables,
            query_lens=query_lens,
            seq_lens_cpu=[prefix + max(query_lens)] + [0] * (len(query_lens) - 1),
            block_size=self.block_size,
        )


def _max_prefix(host: HostInputs, num_decodes: int) -> int:
    """The longest cached prefix of the pass's chunks (its decodes' contexts are the decode kernel's)."""
    return int((host.seq_lens[num_decodes:] - np.diff(host.query_start)[num_decodes:]).max(initial=0))


def graph_token_sizes(max_tokens: int) -> tuple[int, ...]:
    """The sizes of PREFILL_GRAPH_TOKENS up to the first that holds max_tokens (all of them if none does)."""
    last = next((i for i, size in enumerate(PREFILL_GRAPH_TOKENS) if size >= max_tokens), len(PREFILL_GRAPH_TOKENS) - 1)
    return PREFILL_GRAPH_TOKENS[: last + 1]


def _padding_inputs() -> HostInputs:
    empty = np.zeros(0, dtype=np.int64)
    return HostInputs(empty, empty, np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros((0, 0), np.int32), empty)
