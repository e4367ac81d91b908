"""Engine step intervals as a cumulative histogram: what a decode stream's inter-token latency is at the
worker, before the router and the network add theirs.

The counters only grow, so a reader diffs two snapshots to get the distribution of any time window (a
benchmark run); bucket bounds are fixed, as in a Prometheus histogram.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping

STEP_BUCKETS_MS = (0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7.5, 10, 15, 20, 30, 50, 75, 100, 200, 500)
"""Upper bounds (ms) of the buckets; one more bucket takes everything slower."""


def bucket_name(i: int) -> str:
    return f"step_ms_le_{STEP_BUCKETS_MS[i]:g}" if i < len(STEP_BUCKETS_MS) else "step_ms_le_inf"


class StepTimer:
    """Counts the interval between consecutive engine steps that produced output while requests were running;
    an idle gap (no running requests in between) starts over."""

    def __init__(self) -> None:
        self.counts = [0] * (len(STEP_BUCKETS_MS) + 1)
        self._last: float | None = None

    def mark(self, busy: bool, now: float | None = None) -> None:
        """After a step: busy = it produced output and requests remain."""
        now = time.perf_counter() if now is None else now
        if self._last is not None:
            self.counts[bisect.bisect_left(STEP_BUCKETS_MS, (now - self._last) * 1e3)] += 1
        self._last = now if busy else None

    def counters(self) -> dict[str, int]:
        return {bucket_name(i): c for i, c in enumerate(self.counts)}


def quantile_ms(before: Mapping[str, int], after: Mapping[str, int], q: float) -> float | None:
    """Upper bound (ms) of the bucket holding quantile q of the steps counted between two snapshots; None if
    none were; inf if it lies beyond the last bound."""
    diffs = [after.get(bucket_name(i), 0) - before.get(bucket_name(i), 0) for i in range(len(STEP_BUCKETS_MS) + 1)]
    total = sum(diffs)
    if total <= 0:
        return None
    seen = 0
    for i, n in enumerate(diffs):
        seen += n
        if seen >= q * total:
            return STEP_BUCKETS_MS[i] if i < len(STEP_BUCKETS_MS) else float("inf")
    return float("inf")
