"""The load counts routing and admission read, shared by the front ends (router processes) of one cluster.

Each front end counts, per worker, what its own requests hold (router/requests.py RequestTable): requests and
prompt tokens at prefill, requests and reserved KV blocks at decode. With several front ends, every one of them
must route and admit by the whole cluster's counts, so each publishes its counts in its own row of an int64
array in a file of the run dir that every front end maps: [num_frontends, NUM_COUNTERS, num_slots]. A front end
writes only its own row (plain stores, no locks: one writer per row) and reads the column sums.

NOTE: a sum read while another front end writes may be one request stale; admission may then let a few requests
(at most one per other front end) past a decode worker's last free blocks: they wait in its queue.
A front end zeroes its row when it starts, so a restarted one drops what its lost streams held; the supervisor
restarts a dead one, and until then its row still counts (routing around it is conservative, nothing leaks).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

NUM_AT_PREFILL, TOKENS_AT_PREFILL, NUM_AT_DECODE, RESERVED_AT_DECODE = range(4)
NUM_COUNTERS = 4
FILE_PREFIX = "frontend-loads-"


def slots_for(num_prefill: int, num_decode: int) -> int:
    """Columns per counter: one per worker id of either role, and the last for COLOCATED (-1) at prefill."""
    return max(num_prefill, num_decode) + 1


def table_path(run_dir: str | Path, num_frontends: int, num_slots: int) -> Path:
    """The file of a cluster of this shape (the shape is in the name: a file of another shape is never mapped)."""
    return Path(run_dir) / f"{FILE_PREFIX}{num_frontends}x{num_slots}.i64"


def remove_tables(run_dir: str | Path) -> None:
    """Every load table file in run_dir (the launcher, before it starts the front ends of a new cluster)."""
    for path in Path(run_dir).glob(f"{FILE_PREFIX}*"):
        path.unlink(missing_ok=True)


class SharedLoads:
    """One front end's view of the shared table: writes its own row, reads the sums over every row."""

    def __init__(self, path: str | Path, num_frontends: int, frontend: int, num_slots: int) -> None:
        if not 0 <= frontend < num_frontends:
            raise ValueError(f"front end {frontend} of {num_frontends}")
        shape = (num_frontends, NUM_COUNTERS, num_slots)
        size = int(np.prod(shape)) * 8
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:  # NOTE: another front end may have grown it already (zeros either way)
                os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self.array: np.ndarray = np.memmap(path, dtype=np.int64, mode="r+", shape=shape)
        """[num_frontends, NUM_COUNTERS, num_slots]"""
        self.row: np.ndarray = self.array[frontend]
        """[NUM_COUNTERS, num_slots]: this front end's counts (a view: writes go to the file)."""
        self.row[:] = 0

    @classmethod
    def open(
        cls, run_dir: str | Path, num_frontends: int, frontend: int, num_prefill: int, num_decode: int
    ) -> SharedLoads:
        num_slots = slots_for(num_prefill, num_decode)
        return cls(table_path(run_dir, num_frontends, num_slots), num_frontends, frontend, num_slots)

    def write(self, counter: int, worker: int, value: int) -> None:
        """This front end's count `counter` of `worker` (-1: the last slot) is now value."""
        self.row[counter, worker] = value

    def totals(self, counter: int) -> np.ndarray:  # [num_slots] int64
        """counter of each worker, summed over the front ends."""
        return self.array[:, counter, :].sum(axis=0)  # type: ignore[no-any-return]
