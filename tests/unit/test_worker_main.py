"""The worker processes' entry point (core/worker_main.py): flags reach the process before the engine is built."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.core import worker_main
from pdserve.core.config import EngineConfig
from pdserve.core.lifecycle import STARTUP_ERROR_EXIT
from pdserve.core.rank_follower import RankFollower
from pdserve.core.worker_base import WorkerBase


def _no_ranks(cfg: EngineConfig, args: argparse.Namespace) -> RankFollower:
    raise AssertionError("TP size 1 starts no other rank")


@pytest.fixture
def torch_threads() -> Iterator[int]:
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_cpu_threads_are_set_before_the_engine_is_built(
    tiny_llama_dir: Path, tmp_path: Path, torch_threads: int, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[int] = []

    def factory(cfg: EngineConfig, args: argparse.Namespace, group: object) -> WorkerBase:
        seen.append(torch.get_num_threads())
        raise ValueError("stop here")

    common = ["--model", str(tiny_llama_dir), "--worker-id", "0", "--run-dir", str(tmp_path)]
    want = 3 if torch_threads != 3 else 2
    assert worker_main.main("prefill", factory, _no_ranks, [*common, "--cpu-threads", str(want)]) == STARTUP_ERROR_EXIT
    assert seen == [want]
    assert "cannot start: stop here" in capsys.readouterr().err
    torch.set_num_threads(torch_threads)
    worker_main.main("prefill", factory, _no_ranks, [*common, "--cpu-threads", "0"])  # 0: torch's default is left alone
    assert seen == [want, torch_threads]
