"""Persistent inputs of decode passes: token ids, positions, sequence lengths and block tables.

A decode pass (every running sequence brings one new token) is the hot loop. Its inputs live in buffers
allocated once for max_batch rows; each step writes the host copies in place and moves them to the
device with at most three copies. Row i of the block tables keeps the blocks of the request that ran in
row i last step, so an identity batch (the same requests in the same order) rewrites nothing but the
blocks a request gained. Rows past the batch are padding: token 0 at position 0 of the null block 0 with
length 0, so a captured CUDA graph of a larger batch writes only the null block and reads nothing.

NOTE: block-table entries past a request's length may be stale; kernels never read them (they stop at
seq_lens), and a padding row's first entry is always the null block.

Tokens still on the device: while a decode step is in flight, the engine launches the next one before the
host has read the tokens the first one sampled. Those rows take their input id on the device from
`sampled` (the in-flight step's tokens, by its row): the host stages id 0 and the source row, the rest
stage their known id and the always-zero slot sampled[max_batch]; one gather and one add, in place.

TP groups: rank 0 stages rows from its requests; the other ranks hold no requests and take its staging as it is
(staged_rows, the table rows it rewrote, stage_rows), so every rank's buffers hold the same batch.

NOTE: the host staging is rewritten only once the previous load's copies have left it (an event). The engine
waits for the in-flight step's sampled tokens, not for the next step's input copies queued after them: on a
GPU busy with other work (another process time-slicing it, an MPS server cleaning up a killed client) those
copies would otherwise read the inputs of the step after, and the step would run at the wrong positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pdserve.core.parallel import tp_group
from pdserve.core.request import Request
from pdserve.kernels.attention import AttentionMetadata


class DecodeBatch:
    """Preallocated decode inputs on the device, with host staging (pinned on CUDA)."""

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.max_batch, self.max_blocks, self.block_size, self.device = max_batch, max_blocks, block_size, device
        pin = device.type == "cuda"
        # [ids; positions; row of `sampled` added to the id]
        self.ids_pos_cpu = torch.zeros(3, max_batch, dtype=torch.int64, pin_memory=pin)
        self.seq_lens_cpu = torch.zeros(max_batch, dtype=torch.int32, pin_memory=pin)
        self.tables_cpu = torch.zeros(max_batch, max_blocks, dtype=torch.int32, pin_memory=pin)
        on_host = device.type == "cpu"
        self.ids_pos = self.ids_pos_cpu if on_host else self.ids_pos_cpu.to(device)
        self.seq_lens = self.seq_lens_cpu if on_host else self.seq_lens_cpu.to(device)
        self.block_tables = self.tables_cpu if on_host else self.tables_cpu.to(device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._ids_pos_np = self.ids_pos_cpu.numpy()
        self._seq_lens_np = self.seq_lens_cpu.numpy()
        self._tables_np = self.tables_cpu.numpy()
        self.sampled = torch.zeros(max_batch + 1, dtype=torch.int64, device=device)  # [max_batch + 1], last 0
        self._gathered = torch.zeros(max_batch, dtype=torch.int64, device=device)
        # What row i of the host block table holds: (request, its blocks_epoch, number of its blocks).
        self._rows: list[tuple[Request | None, int, int]] = [(None, 0, 0)] * max_batch
        self._copied = None if on_host else torch.cuda.Event()  # recorded after each load's copies to the device
        self._tables_dirty = False  # the staged block tables differ from the device's
        self.table_changes: list[list[int]] | None = None
        """Rank 0 of a TP group: the block-table rows stage() rewrote, for the other ranks (record_tables)."""

    @property
    def input_ids(self) -> torch.Tensor:
        return self.ids_pos[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.ids_pos[1]

    def load(self, reqs: Sequence[Request], padded: int, sampled_rows: Sequence[int] | None = None) -> list[int]:
        """Stage the next token of each request in rows [0, len(reqs)), padding up to `padded`, and copy
        to the device. Returns the sequence lengths (host ints).

        sampled_rows[i] >= 0: request i's next token is not on the host yet; it is sampled[sampled_rows[i]].
        """
        lens = self.stage(reqs, padded, sampled_rows)
        self.upload(len(reqs), padded, sampled_rows is not None)
        return lens

    def stage(self, reqs: Sequence[Request], padded: int, sampled_rows: Sequence[int] | None = None) -> list[int]:
        """load()'s host half: the rows written into the host staging, nothing on the device yet."""
        n = len(reqs)
        assert n <= padded <= self.max_batch, f"batch {n} padded to {padded} exceeds {self.max_batch} rows"
        if self._copied is not None:
            self._copied.synchronize()  # NOTE: the last load's copies are out of the staging (see the module's NOTE)
        ids_pos, seq_lens = self._ids_pos_np, self._seq_lens_np
        positions = [req.num_computed_tokens for req in reqs]
        lens = [pos + 1 for pos in positions]
        if sampled_rows is None:
            ids_pos[0, :n] = [req.token_ids[pos] for req, pos in zip(reqs, positions, strict=True)]
        else:
            staged = zip(reqs, positions, sampled_rows, strict=True)
            ids_pos[0, :n] = [0 if r >= 0 else req.token_ids[p] for req, p, r in staged]
            ids_pos[2, :n] = [r if r >= 0 else self.max_batch for r in sampled_rows]
        ids_pos[1, :n] = positions
        seq_lens[:n] = lens
        tables_dirty = any([self._load_row(i, req) for i, req in enumerate(reqs)])  # NOTE: a list: every row loads
        ids_pos[:2, n:padded] = 0
        seq_lens[n:padded] = 0
        for i in range(n, padded):
            tables_dirty |= self._clear_row(i)
        self._tables_dirty = tables_dirty
        return lens

    def upload(self, n: int, padded: int, gathers: bool) -> None:
        """load()'s device half: copy the staged rows to the device; `gathers`: rows take their id from
        `sampled` (rank 0's, in a TP group: every rank reads the tokens rank 0 sampled)."""
        self._to_device(padded, self._tables_dirty)
        if gathers:
            tp_group().broadcast(self.sampled)
            gathered = torch.index_select(self.sampled, 0, self.ids_pos[2, :n], out=self._gathered[:n])
            self.ids_pos[0, :n].add_(gathered)

    def staged_rows(self, padded: int) -> tuple[np.ndarray, np.ndarray]:
        """The host staging of rows [0, padded): ([3, padded] int64 ids, positions, sampled rows; [padded] int32
        sequence lengths), as stage() left it (what another rank's stage_rows takes)."""
        return self._ids_pos_np[:, :padded], self._seq_lens_np[:padded]

    def take_table_changes(self) -> list[list[int]]:
        """The block-table rows stage() rewrote since the last call, as [row, start, *block ids from start]
        (record_tables must be on)."""
        assert self.table_changes is not None, "record_tables() was not called"
        changes, self.table_changes = self.table_changes, []
        return changes

    def record_tables(self) -> None:
        """From now on stage() records which block-table rows it rewrites (take_table_changes)."""
        self.table_changes = []

    def stage_rows(
        self, n: int, ids_pos: np.ndarray, seq_lens: np.ndarray, table_changes: list[list[int]]
    ) -> list[int]:
        """Another rank's staged rows [0, padded) (staged_rows, take_table_changes) as our staging: the same
        batch, row for row. Returns the sequence lengths of its first n rows (the rest are padding)."""
        padded = seq_lens.shape[0]
        if self._copied is not None:
            self._copied.synchronize()
        self._ids_pos_np[:, :padded] = ids_pos
        self._seq_lens_np[:padded] = seq_lens
        for row, start, *blocks in table_changes:
            self._tables_np[row, start : start + len(blocks)] = blocks
        self._tables_dirty = bool(table_changes)
        return seq_lens[:n].tolist()

    def _load_row(self, row: int, req: Request) -> bool:
        blocks = req.block_ids
        held, epoch, num_held = self._rows[row]
        start = num_held if held is req and epoch == req.blocks_epoch else 0
        if start == len(blocks):
            return False
        self._tables_np[row, start : len(blocks)] = blocks[start:]
        self._rows[row] = (req, req.blocks_epoch, len(blocks))
        if self.table_changes is not None:
            self.table_changes.append([row, start, *blocks[start:]])
        return True

    def _clear_row(self, row: int) -> bool:
        if self._rows[row][0] is None and self._tables_np[row, 0] == 0:
            return False
        self._tables_np[row, 0] = 0
        self._rows[row] = (None, 0, 0)
        if self.table_changes is not None:
            self.table_changes.append([row, 0, 0])
        return True

    def _to_device(self, padded: int, tables_dirty: bool) -> None:
        if self.device.type == "cpu":
            return
        self.ids_pos[:, :padded].copy_(self.ids_pos_cpu[:, :padded], non_blocking=True)  # NOTE: row 2 may be stale
        self.seq_lens[:padded].copy_(self.seq_lens_cpu[:padded], non_blocking=True)
        if tables_dirty:
            self.block_tables[:padded].copy_(self.tables_cpu[:padded], non_blocking=True)
        assert self._copied is not None
        self._copied.record()

    def metadata(self, batch: int, seq_lens: list[int]) -> AttentionMetadata:
        """The attention metadata of rows [0, batch): views of the persistent buffers."""
        return AttentionMetadata(
            slot_mapping=None,
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            query_lens=[1] * batch,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
            positions=self.positions[:batch],
        )
