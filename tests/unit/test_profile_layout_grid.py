"""scripts/profile_layout.py's decode grid on a pool too small for its largest batch: the batch it measures
instead must run every sequence through the timed steps (none preempted), its whole output budget counted in
whole blocks, and the grid point beyond the pool is extrapolated and marked so."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def profile_layout() -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "scripts"))  # NOTE: write_model imports make_bench_model when called
        yield importlib.import_module("profile_layout")


def test_largest_fitting_counts_the_output_budget_in_whole_blocks(profile_layout: Any) -> None:
    grid = profile_layout.Grid((16,), (1, 4), (128,), 64, 3, 2, (), (4, 128))
    # NOTE: a sequence holds 128 prompt + 23 output tokens = 10 blocks of 16; 4 of them need 640 tokens
    assert profile_layout.output_budget(4, 128, 3, 64) == 23
    assert profile_layout.fits(640, 4, 128, grid, 16) and not profile_layout.fits(639, 4, 128, grid, 16)
    assert profile_layout.largest_fitting(592, 4, 128, grid, 16) == 3
    assert profile_layout.largest_fitting(100, 4, 128, grid, 16) == 1


def test_decode_grid_measures_the_largest_batch_the_pool_holds(profile_layout: Any, tmp_path: Path) -> None:
    grid = profile_layout.Grid((16,), (1, 4), (128,), 64, 3, 2, (), (4, 128))
    folder = profile_layout.write_model("llama-8b", tmp_path, dict(profile_layout.TINY))
    engine = profile_layout.make_engine(folder, "cpu", grid, 38, profile_layout.ParallelConfig())
    capacity = (engine.pool.num_blocks - 1) * engine.config.cache.block_size
    assert capacity == 592  # NOTE: 4 x (128 + 3 + 16) = 588 fit the count without the output budget
    points = profile_layout.decode_grid(engine, grid, capacity)
    assert [(p["batch"], p["context"], p.get("extrapolated", False)) for p in points] == [
        (1, 128, False),
        (4, 128, True),
    ]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1
