"""CUDA graphs of decode passes: one graph per batch size in a fixed set, padded up to the next size.

Each graph runs the whole model and the logits head on the persistent inputs of a DecodeBatch; a step
loads its requests into the batch and replays the graph of the smallest captured size that holds them.

NOTE: sizes are captured largest first so every graph shares one memory pool and the attention
backend's workspaces are allocated (by the first, largest warm-up) before any capture.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pdserve.core.decode_batch import DecodeBatch
from pdserve.kernels.attention import AttentionBackend

DecodeForward = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]
"""(input_ids [batch], positions [batch], metadata) -> logits [batch, vocab] float32."""


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool: Any) -> Iterator[None]:  # pool: torch.cuda.graph_pool_handle()
    """torch.cuda.graph with Python's cyclic collector off until the capture ends.

    NOTE: torch collects before a capture, but a collection the capture's own allocations trigger may free
    unrelated garbage holding CUDA objects (a dropped engine's events and graphs), whose destructors make CUDA
    calls a capture forbids: the process aborted so in a GPU test run (2026-11-26, test_engine_cuda capturing
    after an earlier test's engines were dropped).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch, and max_batch itself; ascending."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch}
    sizes.update(range(16, max_batch + 1, 16))
    sizes.add(max_batch)
    return sorted(sizes)


class DecodeGraphs:
    """Captured decode passes keyed by padded batch size."""

    def __init__(self, forward: DecodeForward, batch: DecodeBatch, backend: AttentionBackend, sizes: list[int]) -> None:
        self.forward, self.batch, self.backend = forward, batch, backend
        self.sizes = sorted(sizes)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, n: int) -> int:
        """The smallest captured size that holds n rows."""
        return next(s for s in self.sizes if s >= n)

    @torch.inference_mode()
    def capture(self) -> None:
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture_one(size)

    def _capture_one(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self.batch
        batch.load([], size)  # every row padding: the warm-up and the capture write only the null block
        meta = batch.metadata(size, [0] * size)
        self.backend.prepare(meta)
        ids, pos = batch.input_ids[:size], batch.positions[:size]
        self.forward(ids, pos, meta)  # warm-up: compiles kernels, allocates workspaces
        torch.cuda.synchronize(batch.device)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, self._pool):
            logits = self.forward(ids, pos, meta)  # [size, vocab]
        return graph, logits

    def replay(self, n: int) -> torch.Tensor:  # [n, vocab] float32, a view of the graph's output
        """Run the graph for the n rows already loaded into the batch (padded to a captured size)."""
        graph, logits = self._graphs[self.padded_size(n)]
        graph.replay()
        return logits[:n]
