"""A prefill worker's rank > 0 of its TP group: its shard of the model and of the KV pool, exported for the
decode workers' ranks by every transport rank 0 exports (rank 0 sends them every rank's descriptor in its
handshake reply)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

import torch

from pdserve.core import ipc
from pdserve.core.busy_poll import busy_poll_seconds
from pdserve.core.config import EngineConfig
from pdserve.core.model_runner import ModelRunner
from pdserve.core.rank_follower import RankFollower
from pdserve.kvtransfer.base import KVTransferSource
from pdserve.kvtransfer.factory import AUTO, make_source
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.pool import KVPool, allocate_kv_pool
from pdserve.prefill_worker.worker import pair_kinds, source_kinds

log = logging.getLogger(__name__)


class PrefillRank(RankFollower):
    """Runs rank 0's prefill passes on its shard; exports its pool by each transport rank 0 opens (the same
    kinds, from the same flags and topology: prefill_worker.worker.source_kinds)."""

    def __init__(self, cfg: EngineConfig, args: argparse.Namespace) -> None:
        super().__init__(args.tp_rank, args.tp_group, busy_poll_seconds(args.busy_poll_ms, cfg.device))
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        pairs = pair_kinds(args.transport, args.run_dir, args.worker_id, args.num_decode, self.device)
        self.kinds = source_kinds(args.transport, pairs)
        self.kv_pool: KVPool | None = None
        # the same config as rank 0's engine (prefill_worker/worker.py): the same graphs, the same collectives
        self.runner = ModelRunner(dataclasses.replace(cfg, capture_decode=False), kv_allocator=self._allocate_pool)
        if self.device.type == "cuda":
            self.runner.warmup()
        self.sources: dict[str, KVTransferSource] = {}
        self.source_errors: dict[str, str] = {}  # kind -> why it cannot open (rank 0 refuses the kind then)
        self._open_sources(args.transport, ipc.host_of(args.run_dir, "prefill", args.worker_id))

    def _allocate_pool(self, num_blocks: int) -> torch.Tensor:
        layout = KVLayout.from_engine_config(self.cfg, num_blocks)
        self.kv_pool = allocate_kv_pool(layout, self.device, shared="shm" in self.kinds)
        return self.kv_pool.tensor

    def _open_sources(self, transport: str, host: str) -> None:
        """As rank 0: a forced transport must open (this rank fails to start otherwise); under auto, a kind that
        cannot be opened is reported to rank 0 instead of a descriptor."""
        assert self.kv_pool is not None
        for kind in self.kinds:
            try:
                self.sources[kind] = make_source(kind, self.kv_pool, host)
            except (RuntimeError, ValueError, OSError) as exc:
                if transport != AUTO:
                    raise
                self.source_errors[kind] = str(exc)
                log.error("cannot open the %s KV transport: %s", kind, exc)

    def descriptors(self) -> dict[str, Any]:
        errors = {kind: {"error": error} for kind, error in self.source_errors.items()}
        return {**errors, **{kind: source.descriptor() for kind, source in self.sources.items()}}

    def close(self) -> None:
        super().close()
        for source in self.sources.values():
            source.close()
        if self.kv_pool is not None:
            self.kv_pool.close()
