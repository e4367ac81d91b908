"""DecodeBatch: persistent decode inputs follow each request's tokens and blocks; padding rows are inert."""

from __future__ import annotations

import torch

from pdserve.core.decode_batch import DecodeBatch
from pdserve.core.request import Request
from pdserve.core.sampler import SamplingState
from pdserve.core.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], blocks: list[int]) -> Request:
    req = Request(rid, list(tokens), len(tokens), SamplingState(SamplingParams(), ()))
    req.block_ids.extend(blocks)
    req.num_computed_tokens = len(tokens) - 1
    return req


def table_row(batch: DecodeBatch, row: int, n: int) -> list[int]:
    return batch.block_tables[row, :n].tolist()


def test_rows_hold_each_requests_next_token_position_and_blocks() -> None:
    batch = DecodeBatch(max_batch=4, max_blocks=8, block_size=4, device=torch.device("cpu"))
    a = make_request("a", [5, 6, 7, 8, 9], [3, 7])
    b = make_request("b", [11, 12], [2])
    lens = batch.load([a, b], padded=2)
    assert lens == [5, 2]
    assert batch.input_ids[:2].tolist() == [9, 12]
    assert batch.positions[:2].tolist() == [4, 1]
    assert batch.seq_lens[:2].tolist() == [5, 2]
    assert table_row(batch, 0, 2) == [3, 7] and table_row(batch, 1, 1) == [2]


def test_appended_block_and_replaced_tail_reach_the_table() -> None:
    batch = DecodeBatch(max_batch=2, max_blocks=8, block_size=4, device=torch.device("cpu"))
    a = make_request("a", [1, 2, 3, 4], [3])
    batch.load([a], padded=1)
    a.token_ids.append(9)
    a.num_computed_tokens += 1
    a.block_ids.append(6)
    batch.load([a], padded=1)
    assert table_row(batch, 0, 2) == [3, 6]
    a.block_ids[-1] = 4  # a copy-on-write of a shared tail replaces the last block in place
    a.blocks_epoch += 1
    batch.load([a], padded=1)
    assert table_row(batch, 0, 2) == [3, 4]


def test_a_different_request_in_a_row_rewrites_it_from_the_start() -> None:
    batch = DecodeBatch(max_batch=2, max_blocks=8, block_size=4, device=torch.device("cpu"))
    batch.load([make_request("a", [1] * 9, [3, 4, 5])], padded=1)
    batch.load([make_request("b", [2] * 6, [8, 9])], padded=1)
    assert table_row(batch, 0, 2) == [8, 9]


def test_padding_rows_point_at_the_null_block_with_length_zero() -> None:
    batch = DecodeBatch(max_batch=4, max_blocks=8, block_size=4, device=torch.device("cpu"))
    reqs = [make_request(str(i), [i + 1] * 6, [i + 1, i + 5]) for i in range(3)]
    batch.load(reqs, padded=3)
    batch.load(reqs[:1], padded=4)
    assert batch.seq_lens.tolist() == [6, 0, 0, 0]
    assert batch.input_ids.tolist() == [1, 0, 0, 0] and batch.positions.tolist() == [5, 0, 0, 0]
    assert batch.block_tables[1:, 0].tolist() == [0, 0, 0]
    meta = batch.metadata(1, [6])
    assert meta.slot_mapping is None and meta.positions is not None and meta.positions.tolist() == [5]
    assert meta.query_start_loc.tolist() == [0, 1]
