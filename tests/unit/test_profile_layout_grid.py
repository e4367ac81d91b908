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


def test_a_load_refused_before_it_ran_is_started_once_more_and_one_that_ran_is_not(
    profile_layout: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def refused_then(ran: bool, fails: int) -> Any:
        def run_pair(self: Any, share: int, roles: tuple[str, ...], beside: int | None, out: Path) -> None:
            calls.append(share)
            if len(calls) <= fails:
                raise profile_layout.LoadFailed("the decode load beside the measurement exited (1)", ran)
            out.write_text('{"prefill": 2.5}')

        return run_pair

    monkeypatch.setattr(profile_layout.time, "sleep", lambda s: None)
    children = profile_layout.MpsChildren(None, None, tmp_path, 64)
    monkeypatch.setattr(profile_layout.MpsChildren, "run_pair", refused_then(ran=False, fails=1))
    assert children.measure(50, ("prefill",), beside=50) == {"prefill": 2.5} and calls == [50, 50]
    calls.clear()
    monkeypatch.setattr(profile_layout.MpsChildren, "run_pair", refused_then(ran=False, fails=2))
    with pytest.raises(profile_layout.LoadFailed):
        children.measure(30, ("prefill",), beside=70)
    assert calls == [30, 30]
    calls.clear()
    monkeypatch.setattr(profile_layout.MpsChildren, "run_pair", refused_then(ran=True, fails=1))
    with pytest.raises(profile_layout.LoadFailed):  # NOTE: a load that died while running voids the measurement
        children.measure(70, ("prefill",), beside=30)
    assert calls == [70]
