"""A pass as rank 0 of a TP group sends it to the other ranks: its host inputs, as bytes (core/messages.py).

Rank 0 builds every pass's inputs from its requests; the other ranks hold no requests, block tables or
scheduler: they run the same pass on the same inputs (ModelRunner.replay), so their collectives meet rank 0's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.core.decode_batch import DecodeBatch
from pdserve.core.messages import RankDecodeCmd, RankPassCmd
from pdserve.core.prefill_staging import HostInputs

HOST_DTYPES = (np.int64, np.int64, np.int32, np.int32, np.int32, np.int64)
"""The dtypes of HostInputs' fields, in order."""


def pass_cmd(host: HostInputs, copies: list[list[int]]) -> RankPassCmd:
    return RankPassCmd(copies, [np.ascontiguousarray(a).tobytes() for a in host], len(host.seq_lens))


def host_inputs(cmd: RankPassCmd) -> HostInputs:
    """The HostInputs pass_cmd sent (read-only views of the frame's bytes)."""
    arrays = [np.frombuffer(raw, dtype) for raw, dtype in zip(cmd.arrays, HOST_DTYPES, strict=True)]
    ids, logits_idx, query_start, seq_lens, tables, row_seqs = arrays
    return HostInputs(ids, logits_idx, query_start, seq_lens, tables.reshape(cmd.num_seqs, -1), row_seqs)


def decode_cmd(batch: DecodeBatch, n: int, padded: int, gathers: bool, copies: list[list[int]]) -> RankDecodeCmd:
    """The decode pass batch just staged (stage()) for rows [0, n), padded to `padded`."""
    ids_pos, seq_lens = batch.staged_rows(padded)
    return RankDecodeCmd(copies, n, ids_pos.tobytes(), seq_lens.tobytes(), batch.take_table_changes(), gathers)


def stage_decode(batch: DecodeBatch, cmd: RankDecodeCmd) -> list[int]:
    """Stage cmd's rows in batch (another rank's); the sequence lengths of its first num_seqs rows."""
    seq_lens = np.frombuffer(cmd.seq_lens, np.int32)
    ids_pos = np.frombuffer(cmd.ids_pos, np.int64).reshape(3, len(seq_lens))
    return batch.stage_rows(cmd.num_seqs, ids_pos, seq_lens, cmd.table_changes)


def copies_of(src: Sequence[int], dst: Sequence[int]) -> list[list[int]]:
    return [list(src), list(dst)] if src else []
