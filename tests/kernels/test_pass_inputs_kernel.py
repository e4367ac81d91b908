"""Positions and slots computed on the device (inside prefill graphs) equal the host's, padding included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kernels.pass_inputs import fill_positions_slots, token_positions_slots

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("num_seqs", "num_real", "padding"), [(8, 8, 0), (8, 3, 37), (8, 1, 1), (1, 1, 2000)])
def test_device_positions_and_slots_equal_the_host_s(seed: int, num_seqs: int, num_real: int, padding: int) -> None:
    rng = np.random.default_rng(seed)
    q_lens = rng.integers(1, 700, num_real)
    cached = rng.integers(0, 900, num_real) * rng.integers(0, 2, num_real)  # some sequences with a cached prefix
    seq_lens = cached + q_lens
    width = 128
    tables = np.zeros((num_seqs, width), np.int32)
    tables[:num_real] = rng.integers(1, 5000, (num_real, width))
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    n = int(query_start[-1])
    # graph layout: padding sequences have query length 0 (they start at n) and length 0
    query_start = np.concatenate([query_start, np.full(num_seqs - num_real, n)]).astype(np.int32)
    seq_lens_all = np.concatenate([seq_lens, np.zeros(num_seqs - num_real)]).astype(np.int32)
    want_pos, want_slots = token_positions_slots(query_start, seq_lens_all, tables, 16)
    positions = torch.full((n + padding,), -1, dtype=torch.int64, device="cuda")
    slots = torch.full((n + padding,), -1, dtype=torch.int64, device="cuda")
    dev = {k: torch.from_numpy(v).cuda() for k, v in (("q", query_start), ("s", seq_lens_all), ("t", tables))}
    fill_positions_slots(dev["q"], dev["s"], dev["t"], positions, slots, 16)
    assert positions[:n].cpu().tolist() == want_pos.tolist()
    assert slots[:n].cpu().tolist() == want_slots.tolist()
    assert not positions[n:].any() and not slots[n:].any()  # padding: position 0, slot 0 of the null block
