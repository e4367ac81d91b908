"""Python's cyclic garbage collector kept off the serving path: the startup heap frozen, every pause counted.

A full (generation 2) collection stops the process while it scans every object the collector tracks: the
router holds tens of thousands of them after start-up (a pass takes milliseconds), a worker far more (torch,
the model, the engine). None of that heap is garbage: it lives
as long as the process. At tens of thousands of tokens a second the per-token objects trigger such passes
every few seconds, and each stalls every stream of the process at once. `freeze_startup_heap()` moves what is
alive once start-up is done into the permanent generation (gc.freeze), so later passes scan only what was
allocated since; `GcPauses` times each pass (gc.callbacks). On an H200 host under 64 streams the router's longest
full pass went from 19-23 ms to 4-5 ms (bench/results/gc_freeze_h200/gc_ab.json).

This module imports nothing but the standard library: the router, which never imports torch, uses it too.
NOTE: frozen objects are still freed by reference counting; a reference cycle among them is never collected
(none is made after start-up on purpose: the heap frozen is the process's long-lived state).
"""

from __future__ import annotations

import gc
import time
from typing import Any

GENERATIONS = (0, 1, 2)


def freeze_startup_heap(pauses: GcPauses | None = None) -> int:
    """Collect once, then freeze everything alive: the number of objects frozen (call it once, when ready).

    pauses, if given, starts counting afresh: its numbers are then the serving's, not this collection's.
    """
    gc.collect()
    gc.freeze()
    if pauses is not None:
        pauses.reset()
    return gc.get_freeze_count()


class GcPauses:
    """Counts and times this process's collector passes by generation (registered on gc.callbacks).

    NOTE: the callback only adds to plain lists: it runs wherever an allocation triggers a pass, possibly
    inside code that holds a lock (a Prometheus metric's), so it must take none; exporters read the numbers.
    """

    def __init__(self) -> None:
        self._start = 0.0
        self.reset()
        gc.callbacks.append(self._callback)

    def reset(self) -> None:
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        took, gen = time.perf_counter() - self._start, int(info["generation"])
        self.count[gen] += 1
        self.total_s[gen] += took
        self.max_s[gen] = max(self.max_s[gen], took)

    def counters(self) -> dict[str, int]:
        """Heartbeat counters: passes per generation, and the full passes' total and longest pause in us."""
        out = {f"gc_collections_gen{g}": self.count[g] for g in GENERATIONS}
        out["gc_pause_us_gen2"] = round(self.total_s[2] * 1e6)
        out["gc_pause_us_max"] = round(max(self.max_s) * 1e6)
        return out

    def summary(self) -> str:
        """One log line: passes and pauses per generation."""
        parts = (
            f"gen{g} {self.count[g]} passes, {self.total_s[g] * 1e3:.1f} ms, max {self.max_s[g] * 1e3:.2f} ms"
            for g in GENERATIONS
        )
        return "; ".join(parts)
