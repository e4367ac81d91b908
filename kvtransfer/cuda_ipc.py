"""CUDA transport: each prefill rank's pool memory is exported by CUDA IPC handle; a sink maps the pools of
the ranks holding its KV heads and copies those heads of the blocks out.

Follows torch.multiprocessing.reductions (reduce_tensor / rebuild_cuda_tensor): the source calls
`untyped_storage()._share_cuda_()` once per descriptor (each call gets its own IPC ref-counter slot,
released when the sink drops its mapping), the sink rebuilds the storage with
`torch.UntypedStorage._new_shared_cuda(...)` and views it with the pool's shape and dtype.

NOTE: the GPU is named by UUID in each rank's entry of the group descriptor, so the processes may number devices
differently (CUDA_VISIBLE_DEVICES); the source's GPU must be visible to the sink. Mapping a handle creates a
CUDA context on the source's GPU in the sink process. When the GPUs differ and the sink's GPU can reach the
source's (peer access: NVLink or PCIe P2P), the handle is mapped on the sink's GPU (CUDA enables peer access
lazily) and the block-copy kernel runs there, reading the source pool directly: one launch per head segment
(kvtransfer.base.plan_segments), as on one GPU. Without peer access a segment's heads of the blocks are
gathered on the source's GPU, cross with one copy (staged through the host by CUDA) and are scattered on the
sink's.
NOTE: pulls are asynchronous: every segment's copy runs on the sink's stream, after the work queued on the
caller's current stream and beside what is queued there later, then one event is recorded there; the host only
ever queries that event (PullHandle.done), see kvtransfer.base.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
from pdserve.kvtransfer.pool import KVPool

if TYPE_CHECKING:
    from pdserve.kernels.block_copy import BlockCopy


class CudaIpcSource(KVTransferSource):
    """Exports a CUDA pool; descriptor adds the fields of `_share_cuda_()` and the GPU's UUID."""

    transport = "cuda_ipc"

    def __init__(self, pool: KVPool) -> None:
        t = pool.tensor
        if t.device.type != "cuda" or not t.is_contiguous() or t.storage_offset() != 0:
            raise KVTransferError("the cuda_ipc transport needs a contiguous CUDA pool at offset 0")
        super().__init__(pool)

    def _export(self) -> dict[str, Any]:
        storage = self.pool.tensor.untyped_storage()
        device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = storage._share_cuda_()
        return {
            "device": int(device),
            "device_uuid": _device_uuid(int(device)),
            "handle": bytes(handle),
            "storage_nbytes": int(size),
            "storage_offset": int(offset),
            "ref_counter_handle": bytes(ref_handle),
            "ref_counter_offset": int(ref_offset),
            "event_handle": bytes(event_handle),
            "event_sync_required": bool(event_sync),
        }


class CudaIpcSink(KVTransferSink):
    """Copies blocks from mapped CUDA pools into a local CUDA pool on the sink's own streams, beside the caller's
    current stream; nobody waits for them (pull returns a handle to poll)."""

    transport = "cuda_ipc"

    def __init__(self, local_pool: KVPool, layout: KVLayout) -> None:
        if local_pool.device.type != "cuda":
            raise KVTransferError(f"the cuda_ipc transport copies into a CUDA pool, not {local_pool.device}")
        super().__init__(local_pool, layout)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._reads: dict[torch.device, bool] = {local_pool.device: True}  # may kernels on our GPU read there
        self._plans: dict[tuple[int, Segment], BlockCopy] = {}  # (a remote pool's data_ptr, segment) -> its copy

    def _attach(self, entry: dict[str, Any], remote_layout: KVLayout) -> torch.Tensor:
        device = _local_index(entry)
        local = self.local_pool.device
        if device != local.index and torch.cuda.can_device_access_peer(local, device):
            device = local.index  # NOTE: mapped into our GPU's context: kernels here read it over the link
        storage = _open_storage(entry, device)
        if storage.nbytes() < remote_layout.nbytes:
            raise KVTransferError(f"exported storage has {storage.nbytes()} bytes, the pool {remote_layout.nbytes}")
        flat = torch.empty((0,), dtype=remote_layout.torch_dtype, device=storage.device).set_(storage)
        return flat[: remote_layout.nbytes // remote_layout.torch_dtype.itemsize].view(remote_layout.shape)

    def _copy(
        self, remotes: dict[int, Any], segments: tuple[Segment, ...], src_block_ids: list[int], dst_block_ids: list[int]
    ) -> PullHandle:
        local = self.local_pool.tensor
        local_stream = self._stream(local.device)
        # Earlier work on the local pool (a step still writing blocks freed before this pull) lands before ours.
        local_stream.wait_stream(torch.cuda.current_stream(local.device))
        keep_alive: list[torch.Tensor] = list(remotes.values())
        ids_gpu: torch.Tensor | None = None  # [2, n] source and destination ids, shared by the segments' launches
        with torch.cuda.stream(local_stream):
            for segment in segments:
                remote = remotes[segment.rank]
                if not self._kernel_reads(remote.device):
                    with torch.cuda.stream(self._stream(remote.device)):
                        keep_alive += self._staged_copy(remote, segment, src_block_ids, dst_block_ids)
                    continue
                if ids_gpu is None:
                    ids_cpu, ids_gpu = self._upload_ids(src_block_ids, dst_block_ids)
                    keep_alive += (ids_cpu, ids_gpu)
                self._plan(remote, segment)(ids_gpu[0], ids_gpu[1])
            done = torch.cuda.Event()
            done.record(local_stream)
        return PullHandle(done, tuple(keep_alive))

    def _upload_ids(self, src_block_ids: list[int], dst_block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """[2, n] source and destination ids, pinned on the host and copied to our GPU on the current (sink)
        stream; both must live until the copies that read them have run."""
        ids_cpu = torch.tensor([src_block_ids, dst_block_ids], dtype=torch.long, pin_memory=True)
        return ids_cpu, ids_cpu.to(self.local_pool.device, non_blocking=True)

    def _plan(self, remote: torch.Tensor, segment: Segment) -> BlockCopy:
        """The block-copy launch of one segment on the sink's GPU, reading the remote pool in place (on this
        GPU or a peer's); planned once per mapping and segment (checks, word views): the launch is most of a pull."""
        from pdserve.kernels.block_copy import BlockCopy  # NOTE: imported here: only CUDA sinks need triton

        key = (remote.data_ptr(), segment)
        if key not in self._plans:
            src_heads = (segment.src_head, segment.num_heads)
            dst_heads = (segment.dst_head, segment.num_heads)
            self._plans[key] = BlockCopy(remote, self.local_pool.tensor, src_heads=src_heads, dst_heads=dst_heads)
        return self._plans[key]

    def _detach(self, handle: torch.Tensor) -> None:
        """The plans hold views of the mapped pool: dropping them lets the mapping go."""
        for key in [key for key in self._plans if key[0] == handle.data_ptr()]:
            del self._plans[key]

    def _staged_copy(
        self, remote: torch.Tensor, segment: Segment, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> tuple[torch.Tensor, ...]:
        """Without peer access: gather the segment's heads on the remote GPU, cross with one copy, scatter on ours
        (current streams: the sink's)."""
        local = segment.destination(self.local_pool.tensor)
        src = torch.tensor(src_block_ids, dtype=torch.long, device=remote.device)
        dst = torch.tensor(dst_block_ids, dtype=torch.long, device=local.device)
        blocks = segment.source(remote).index_select(2, src)  # [num_layers, 2, len(src), block_size, heads, d]
        blocks_local = blocks.to(local.device, non_blocking=True)  # staged through the host by CUDA
        local.index_copy_(2, dst, blocks_local)
        return src, dst, blocks, blocks_local

    def _kernel_reads(self, device: torch.device) -> bool:
        """Whether kernels on our GPU can read a pool on `device` (ours, or a peer once peer access is on)."""
        if device not in self._reads:
            self._reads[device] = enable_peer_access(self.local_pool.device, device)
        return self._reads[device]

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def enable_peer_access(local: torch.device, remote: torch.device) -> bool:
    """Whether kernels on `local` can read `remote`'s memory; enables it if so (torch turns peer access on for
    both GPUs of a copy between them: one tiny copy each way)."""
    if not torch.cuda.can_device_access_peer(local, remote):
        return False
    here, there = torch.zeros(1, device=local), torch.zeros(1, device=remote)
    there.copy_(here)
    here.copy_(there)
    torch.cuda.synchronize(local)
    return True


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_index(entry: dict[str, Any]) -> int:
    """This process's index of the source rank's GPU, found by UUID."""
    uuid = descriptor_field(entry, "device_uuid", str)
    torch.cuda.init()
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == uuid:
            return index
    raise KVTransferError(f"the prefill pool's GPU {uuid} is not visible here (CUDA_VISIBLE_DEVICES?)")


def _open_storage(entry: dict[str, Any], device: int) -> torch.UntypedStorage:
    """rebuild_cuda_tensor's steps: map the IPC handle (waiting on the source's event when required)."""
    fields = [
        ("handle", bytes),
        ("storage_nbytes", int),
        ("storage_offset", int),
        ("ref_counter_handle", bytes),
        ("ref_counter_offset", int),
        ("event_handle", bytes),
        ("event_sync_required", bool),
    ]
    args = [descriptor_field(entry, name, kind) for name, kind in fields]
    try:
        return torch.UntypedStorage._new_shared_cuda(device, *args)
    except RuntimeError as exc:
        raise KVTransferError(f"cannot open the CUDA IPC handle: {exc}") from exc
