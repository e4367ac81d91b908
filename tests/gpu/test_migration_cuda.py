"""Worker crashes with request migration on one GPU (cuda_ipc transport, MPS when available): kill -9 a decode
worker and then a prefill worker under 100 streams; every stream finishes with exactly the tokens the same
cluster gave before the crash, nothing leaks, the worker is back (tests/reliability/test_crash.py, on CUDA).
A prefill crash is the case only a GPU shows: a decode worker may still be pulling from the dead worker's
CUDA IPC pool."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, running
from tests.reliability.test_crash import DECODE_LOAD, NUM_DECODE, NUM_PREFILL, PREFILL_LOAD, crash_under_load

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    run = tmp_path_factory.mktemp("run")
    with running(tiny_llama_dir, run, NUM_PREFILL, NUM_DECODE, "--num-blocks", "1024", device="cuda") as c:
        yield c


def test_kill_decode_worker_on_gpu_migrates_its_streams(cluster: Cluster) -> None:
    crash_under_load(cluster, "decode", DECODE_LOAD, lambda progress: min(progress) >= 2)


def test_kill_prefill_worker_on_gpu_migrates_its_streams(cluster: Cluster) -> None:
    crash_under_load(cluster, "prefill", PREFILL_LOAD, lambda progress: sum(p > 0 for p in progress) >= 10)
