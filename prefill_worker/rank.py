"""A prefill worker's rank > 0 of its TP group: its shard of the model and of the KV pool, exported for the
decode workers' ranks (rank 0 sends them every rank's descriptor in its handshake reply)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from pdserve.core.busy_poll import busy_poll_seconds
from pdserve.core.config import EngineConfig
from pdserve.core.model_runner import ModelRunner
from pdserve.core.rank_follower import RankFollower
from pdserve.kvtransfer.base import KVTransferSource, make_source, pair_transport
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.pool import KVPool, allocate_kv_pool


class PrefillRank(RankFollower):
    """Runs rank 0's prefill passes on its shard; exports its pool by the host's transport (shm or cuda_ipc)."""

    def __init__(self, cfg: EngineConfig, args: argparse.Namespace) -> None:
        super().__init__(args.tp_rank, args.tp_group, busy_poll_seconds(args.busy_poll_ms, cfg.device))
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.kind = pair_transport(args.transport, True, self.device)
        self.kv_pool: KVPool | None = None
        # NOTE: the same config as rank 0's engine (prefill_worker/worker.py): the same graphs, the same collectives
        self.runner = ModelRunner(dataclasses.replace(cfg, capture_decode=False), kv_allocator=self._allocate_pool)
        if self.device.type == "cuda":
            self.runner.warmup()
        assert self.kv_pool is not None
        self.source: KVTransferSource = make_source(self.kind, self.kv_pool)

    def _allocate_pool(self, num_blocks: int) -> torch.Tensor:
        layout = KVLayout.from_engine_config(self.cfg, num_blocks)
        self.kv_pool = allocate_kv_pool(layout, self.device, shared=self.device.type == "cpu")
        return self.kv_pool.tensor

    def descriptors(self) -> dict[str, Any]:
        return {self.kind: self.source.descriptor()}

    def close(self) -> None:
        super().close()
        self.source.close()
        if self.kv_pool is not None:
            self.kv_pool.close()
