"""CPU transport: each prefill rank's pool lives in POSIX shared memory; a sink maps those of the ranks holding
its KV heads and copies blocks (those heads of them) out."""

from __future__ import annotations

from typing import Any

import torch

from pdserve.kvtransfer.base import (
    KVTransferError,
    KVTransferSink,
    KVTransferSource,
    PullHandle,
    Segment,
    descriptor_field,
)
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.pool import KVPool, attach_shm_pool


class ShmSource(KVTransferSource):
    """Exports a pool made by allocate_kv_pool(..., shared=True); descriptor adds {"shm_name"}."""

    transport = "shm"

    def __init__(self, pool: KVPool) -> None:
        if pool.shm_name is None or pool.device.type != "cpu":
            raise KVTransferError("the shm transport needs a CPU pool allocated with shared=True")
        super().__init__(pool)

    def _export(self) -> dict[str, Any]:
        if not self.pool.owns_segment:
            raise KVTransferError(f"KV pool {self.pool.shm_name} is closed")
        return {"shm_name": self.pool.shm_name}


class ShmSink(KVTransferSink):
    """Copies blocks from mapped shared-memory pools into a local CPU pool, one index_select/index_copy_ over
    the block dim per head segment of a pull; synchronous, so every handle is done at once."""

    transport = "shm"

    def __init__(self, local_pool: KVPool, layout: KVLayout) -> None:
        if local_pool.device.type != "cpu":
            raise KVTransferError(f"the shm transport copies into a CPU pool, not {local_pool.device}")
        super().__init__(local_pool, layout)

    def _attach(self, entry: dict[str, Any], remote_layout: KVLayout) -> torch.Tensor:
        name = descriptor_field(entry, "shm_name", str)
        try:
            return attach_shm_pool(name, remote_layout).tensor
        except FileNotFoundError:
            raise KVTransferError(f"KV pool {name} is gone (its prefill worker closed or restarted)") from None
        except ValueError as exc:
            raise KVTransferError(str(exc)) from None

    def _copy(
        self, remotes: dict[int, Any], segments: tuple[Segment, ...], src_block_ids: list[int], dst_block_ids: list[int]
    ) -> PullHandle:
        src = torch.tensor(src_block_ids, dtype=torch.long)
        dst = torch.tensor(dst_block_ids, dtype=torch.long)
        for s in segments:
            blocks = s.source(remotes[s.rank]).index_select(2, src)  # [layers, 2, len(src), bs, s.num_heads, d]
            s.destination(self.local_pool.tensor).index_copy_(2, dst, blocks)
        return PullHandle()
