"""A decode worker's rank > 0 of its TP group: its shard of the model and of the KV pool; it opens the prefill
pools rank 0 opened and pulls its own KV heads of every handed-off block (kvtransfer head segments), reporting
each pull once its copy has finished (rank 0 releases the lease only when every rank's has)."""

from __future__ import annotations

import argparse
import logging

import torch

from pdserve.core import ipc
from pdserve.core.busy_poll import busy_poll_seconds
from pdserve.core.config import EngineConfig
from pdserve.core.messages import Message, RankOpenCmd, RankPullCmd, RankPullDoneEvent
from pdserve.core.model_runner import ModelRunner
from pdserve.core.rank_follower import RankFollower
from pdserve.kvtransfer.base import TRANSPORTS, KVTransferError, KVTransferSink, PullHandle
from pdserve.kvtransfer.factory import make_sink
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.pool import KVPool, allocate_kv_pool

log = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A pool rank 0 opened, or a pull it made, failed here: our KV would differ from rank 0's, so the group
    goes down (rank 0 sees this process exit) and the supervisor restarts it."""


class DecodeRank(RankFollower):
    """Runs rank 0's decode passes on its shard; pulls its heads of each handoff rank 0 adopts."""

    def __init__(self, cfg: EngineConfig, args: argparse.Namespace) -> None:
        super().__init__(args.tp_rank, args.tp_group, busy_poll_seconds(args.busy_poll_ms, cfg.device))
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.kv_pool: KVPool | None = None
        self.runner = ModelRunner(cfg, kv_allocator=self._allocate_pool)
        if self.device.type == "cuda":
            self.runner.warmup()
        self.layout = KVLayout.from_engine_config(cfg, self.runner.num_blocks)
        self.sinks: dict[str, KVTransferSink] = {}  # transport -> sink (made on first use)
        self.sink_of: dict[int, KVTransferSink] = {}  # prefill worker -> the sink its pool is open in
        self.pulls: list[tuple[int, PullHandle]] = []  # (pull id, handle) of copies in flight

    def _allocate_pool(self, num_blocks: int) -> torch.Tensor:
        layout = KVLayout.from_engine_config(self.cfg, num_blocks)
        self.kv_pool = allocate_kv_pool(layout, self.device, shared=False)
        return self.kv_pool.tensor

    def handle(self, msg: Message) -> None:
        try:
            if isinstance(msg, RankOpenCmd):
                self._open(msg)
            elif isinstance(msg, RankPullCmd):
                sink = self.sink_of[msg.prefill_worker]
                handle = sink.pull(msg.prefill_worker, msg.src_block_ids, msg.dst_block_ids)
                self.pulls.append((msg.pull_id, handle))
            else:
                super().handle(msg)
        except (KVTransferError, KeyError, ValueError) as exc:
            raise RankFailure(f"TP rank {self.rank}: {type(msg).__name__} failed: {exc}") from exc

    def _open(self, cmd: RankOpenCmd) -> None:
        kind = cmd.descriptor.get("transport")
        if kind not in TRANSPORTS:
            raise KVTransferError(f"a descriptor of transport {kind!r}")
        if kind not in self.sinks:
            assert self.kv_pool is not None
            self.sinks[kind] = make_sink(kind, self.kv_pool, self.layout)
        old = self.sink_of.pop(cmd.prefill_worker, None)
        if old is not None and old is not self.sinks[kind]:
            old.close(cmd.prefill_worker)
        self.sinks[kind].open(cmd.prefill_worker, cmd.descriptor)
        self.sink_of[cmd.prefill_worker] = self.sinks[kind]

    def after_commands(self) -> None:
        if not self.pulls:
            return
        done = {pull_id for pull_id, handle in self.pulls if handle.done()}
        if done:
            self.pulls = [(pull_id, h) for pull_id, h in self.pulls if pull_id not in done]
            ipc.send(self.to_leader, RankPullDoneEvent(self.rank, sorted(done)))

    def has_pending_work(self) -> bool:
        return bool(self.pulls)

    def close(self) -> None:
        for _, handle in self.pulls:
            handle.wait()
        super().close()
        for sink in self.sinks.values():
            sink.close_all()
