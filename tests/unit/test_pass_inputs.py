"""An eager pass's device inputs: every tensor the kernels take starts 16 bytes aligned and block tables are a
multiple of 16 columns wide, whatever the pass's shape (Triton compiles a kernel variant per alignment)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.kernels.pass_inputs import token_positions_slots
from tests.hf_reference import random_prompts
from tests.passes import prompt_plan

SHAPES = [((5,), (5,)), ((3, 17, 40), (3, 17, 9)), ((1, 2, 33, 7, 64), (1, 2, 33, 7, 64)), ((300, 41), (299, 41))]


@pytest.mark.parametrize(("lengths", "chunks"), SHAPES)
def test_eager_pass_tensors_are_aligned_and_tables_16_wide(tiny_llama_dir: Path, lengths, chunks) -> None:
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=128), SchedulerConfig())
    engine = Engine(cfg)
    plan = prompt_plan(engine, random_prompts(1024, lengths, seed=len(lengths)), chunks)
    host = engine.runner._host_inputs(plan)
    dev = engine.runner._to_device(host)
    meta, rows = dev.meta, dev.meta.rows
    assert rows is not None
    tensors = [dev.ids, dev.positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables]
    tensors += [rows.index, rows.meta.query_start_loc, rows.meta.seq_lens, rows.meta.block_tables]
    for t in tensors:
        assert isinstance(t, torch.Tensor) and t.data_ptr() % 16 == 0
    assert meta.block_tables.shape[1] % 16 == 0 and rows.meta.block_tables.shape[1] % 16 == 0
    width = host.tables.shape[1]
    assert torch.equal(meta.block_tables[:, :width], torch.from_numpy(host.tables))
    assert not meta.block_tables[:, width:].any()  # NOTE: padded with the null block
    positions, slots = token_positions_slots(host.query_start, host.seq_lens, host.tables, 16)
    assert torch.equal(dev.positions, torch.from_numpy(positions))
    assert meta.slot_mapping is not None and torch.equal(meta.slot_mapping, torch.from_numpy(slots))
    assert torch.equal(rows.index, torch.from_numpy(host.logits_idx))
    assert torch.equal(rows.meta.seq_lens, torch.from_numpy(host.seq_lens[host.row_seqs]))


def test_positions_and_slots_follow_from_the_sequences_metadata() -> None:
    """A 5-token chunk after a 20-token cached prefix (blocks 7, 3) and a fresh 3-token prompt (block 9)."""
    query_start, seq_lens = np.array([0, 5, 8], np.int32), np.array([25, 3], np.int32)
    tables = np.array([[7, 3], [9, 0]], np.int32)
    positions, slots = token_positions_slots(query_start, seq_lens, tables, 16)
    assert positions.tolist() == [20, 21, 22, 23, 24, 0, 1, 2]
    assert slots.tolist() == [52, 53, 54, 55, 56, 144, 145, 146]
