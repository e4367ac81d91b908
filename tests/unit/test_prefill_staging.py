"""The host staging of a graphed prefill pass (core/prefill_staging.py): decode slots, chunk slots, logits rows
and their padding, for passes loaded one after another into the same buffer."""

from __future__ import annotations

import numpy as np

from pdserve.core.prefill_staging import PREFILL_GRAPH_SEQS, HostInputs, PrefillStaging


def host_pass(query_lens: list[int], seq_lens: list[int], sampling: list[int], width: int = 3) -> HostInputs:
    """A pass whose sequence i has block table [10 i + 1, 10 i + 2, ...] and token ids 100 + its row."""
    ends = np.cumsum(query_lens)
    tables = np.array([[10 * i + j + 1 for j in range(width)] for i in range(len(query_lens))], dtype=np.int32)
    return HostInputs(
        ids=np.arange(100, 100 + int(ends[-1]), dtype=np.int64),
        logits_idx=np.array([ends[i] - 1 for i in sampling], dtype=np.int64),
        query_start=np.array([0, *ends], dtype=np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        tables=tables,
        row_seqs=np.array(sampling, dtype=np.int64),
    )


def test_a_mixed_pass_fills_decode_slots_then_chunk_slots() -> None:
    staging = PrefillStaging(max_tokens=64, decode_slots=4, max_blocks=5, pin=False)
    s = staging.num_slots
    assert s == 4 + PREFILL_GRAPH_SEQS
    # two decodes, a chunk that samples, a chunk that does not
    host = host_pass([1, 1, 6, 4], [9, 20, 6, 30], sampling=[0, 1, 2])
    num_decodes = staging.num_decodes(host)
    assert num_decodes == 2 and staging.fits(host, num_decodes)
    staging.load(host, size=16, num_decodes=num_decodes)
    a = staging.host
    assert a.ids[:12].tolist() == list(range(100, 112)) and not a.ids[12:16].any()
    assert a.logits_idx.tolist() == [0, 1, 7] + [0] * (s - 3)
    # slots 0-1 decodes, 2-3 padding (length 0 at row 2), chunks from slot 4 at their rows in the pass
    assert a.query_start.tolist() == [0, 1, 2, 2, 2, 8, 12] + [12] * (s - 6)
    assert a.seq_lens.tolist() == [9, 20, 0, 0, 6, 30] + [0] * (s - 6)
    assert a.tables[[0, 1, 4, 5], :3].tolist() == [[1, 2, 3], [11, 12, 13], [21, 22, 23], [31, 32, 33]]
    assert not a.tables[[2, 3, 6], 0].any()
    # logits rows: the three sampling sequences, compact
    assert a.row_query_start.tolist() == list(range(s + 1))
    assert a.row_seq_lens.tolist() == [9, 20, 6] + [0] * (s - 3)
    assert a.row_tables[:3, :3].tolist() == [[1, 2, 3], [11, 12, 13], [21, 22, 23]]
    assert not a.row_tables[3:, 0].any()


def test_a_pure_prefill_after_a_mixed_pass_leaves_no_stale_slot() -> None:
    staging = PrefillStaging(max_tokens=64, decode_slots=4, max_blocks=5, pin=False)
    staging.load(host_pass([1, 1, 1, 9], [5, 6, 7, 9], sampling=[0, 1, 2, 3]), 16, num_decodes=3)
    host = host_pass([7, 5], [7, 5], sampling=[0, 1])
    assert staging.num_decodes(host) == 0
    staging.load(host, size=16, num_decodes=0)
    a, s = staging.host, staging.num_slots
    assert a.query_start.tolist() == [0] * 5 + [7] + [12] * (s - 5)
    assert a.seq_lens.tolist() == [0, 0, 0, 0, 7, 5] + [0] * (s - 6)
    assert a.row_seq_lens.tolist() == [7, 5] + [0] * (s - 2)
    assert not a.tables[:4, 0].any() and not a.row_tables[2:, 0].any()
    assert not a.ids[12:16].any()


def test_without_decode_slots_sequences_fill_the_chunk_slots_in_order() -> None:
    staging = PrefillStaging(max_tokens=64, decode_slots=0, max_blocks=5, pin=False)
    host = host_pass([1, 1, 6], [9, 20, 6], sampling=[0, 1, 2])
    assert staging.num_decodes(host) == 0  # no decode slots: every sequence is a chunk
    staging.load(host, size=16, num_decodes=0)
    a = staging.host
    assert a.query_start.tolist() == [0, 1, 2, 8] + [8] * (PREFILL_GRAPH_SEQS - 3)
    assert a.seq_lens.tolist() == [9, 20, 6] + [0] * (PREFILL_GRAPH_SEQS - 3)


def test_passes_a_graph_cannot_hold() -> None:
    staging = PrefillStaging(max_tokens=64, decode_slots=2, max_blocks=5, pin=False)
    nine_chunks = host_pass([2] * 9, [2] * 9, sampling=list(range(9)))
    assert not staging.fits(nine_chunks, staging.num_decodes(nine_chunks))
    three_decodes = host_pass([1, 1, 1, 4], [3, 3, 3, 4], sampling=[0, 1, 2, 3])
    assert not staging.fits(three_decodes, staging.num_decodes(three_decodes))
    wide = host_pass([1, 4], [3, 4], sampling=[0, 1], width=6)
    assert not staging.fits(wide, 1)
    too_long = host_pass([65], [65], sampling=[0])
    assert not staging.fits(too_long, 0)
    assert staging.fits(host_pass([1, 1, 4], [3, 3, 4], sampling=[0, 1, 2]), 2)
