"""Cross-host transport: KV blocks travel over torch.distributed point-to-point on one two-rank process group
per (prefill rank, decode rank) pair: gloo for CPU pools, NCCL for CUDA pools (request headers always go over
gloo). No hand-written sockets carry KV bytes.

Neither side can read the other's memory, so a pull is a request the source answers:
- The source hosts a TCPStore (its address is in its rank's entry of the group descriptor) and a daemon thread
  that watches it for new sessions; each sink that opens the pool registers a session id there and joins a fresh
  gloo group (rank 1) under that prefix, plus an NCCL group for a CUDA pool; the source's thread joins them as
  rank 0 and serves them from its own thread (on its own CUDA stream).
- pull: one request per head segment (kvtransfer.base.plan_segments) per chunk of blocks: the sink sends a
  header [n, src_head, num_heads, block ids...] (gloo, tag 0) to the source of the segment's prefill rank, the
  source gathers heads [src_head, src_head + num_heads) of those blocks of its pool and sends them as one
  tensor (tag 1), the sink scatters them into its segment's heads. Every segment's header is sent and its
  receive posted before the sink waits on any, so the prefill ranks gather and send at once. CPU: synchronous,
  the handle is done on return, so the lease is released as with shm. CUDA: the receives and the scatters are
  enqueued on the sink's current stream without blocking the host; the handle's event completes after them,
  and every source has sent every byte by then, so the lease is released as with cuda_ipc. A header with
  n = -1 ends the session.
NOTE: workers may be TP groups of any sizes: each prefill rank hosts a source of its own pool (its rank entry of
the group descriptor holds its store's address, on its worker's host), and a decode rank opens sessions only
with the prefill ranks its segments read, one session per (prefill rank, decode rank) pair.
NOTE: the serving thread reads leased blocks only (no rank of the prefill worker writes a leased block), so it
needs no lock with the rank's loop.
NOTE: the store binds `host` (loopback unless the worker is told otherwise): crossing hosts is an explicit
opt-in, like every other socket of the cluster.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import uuid
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pdserve.kvtransfer.base import (
    KVTransferError,
    KVTransferSink,
    KVTransferSource,
    PullHandle,
    Segment,
    descriptor_field,
    heads_of,
)
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.pool import KVPool

log = logging.getLogger(__name__)
TIMEOUT = datetime.timedelta(seconds=30)
HEADER_FIELDS = 3
"""Request header fields before the block ids: [n, src_head, num_heads]."""
HEADER_LEN = HEADER_FIELDS + 1024
"""Request header: [n, src_head, num_heads, up to 1024 block ids] (padded)."""
MAX_BLOCKS_PER_MESSAGE = HEADER_LEN - HEADER_FIELDS
"""Blocks per request (a longer pull is split)."""
HEADER_TAG, BLOCKS_TAG = 0, 1
WATCH_INTERVAL_S = 0.02
SESSIONS_KEY = "sessions"


def _groups(store: Any, rank: int, device: torch.device) -> tuple[Any, Any]:
    """(control, data) groups of one session: gloo for headers; the data group is the same gloo group for a
    CPU pool, an NCCL group for a CUDA pool (its communicator is made at the first send/receive)."""
    ctrl = dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)
    if device.type != "cuda":
        return ctrl, ctrl
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = TIMEOUT
    return ctrl, dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, 2, opts)


class DistSource(KVTransferSource):
    """Serves pulls of a pool (CPU or CUDA) to every sink that opens it, each on its own thread and groups."""

    transport = "dist"

    def __init__(self, pool: KVPool, host: str = "127.0.0.1") -> None:
        if pool.device.type not in ("cpu", "cuda"):
            raise KVTransferError(f"the dist transport serves CPU and CUDA pools, not {pool.device}")
        super().__init__(pool)
        self.host = host
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        self.num_served = 0
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="kv-dist-watch", daemon=True).start()

    def _export(self) -> dict[str, Any]:
        return {"host": self.host, "port": int(self.store.port), "device_type": self.pool.device.type}

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        """Start a serving thread for each session a sink registers."""
        seen = 0
        while not self._stop.wait(WATCH_INTERVAL_S):
            count = self.store.add(SESSIONS_KEY, 0)
            for n in range(seen + 1, count + 1):
                session = self.store.get(f"{SESSIONS_KEY}/{n}").decode()
                threading.Thread(target=self._serve, args=(session,), name=f"kv-dist-{n}", daemon=True).start()
            seen = count

    def _serve(self, session: str) -> None:
        device = self.pool.device
        try:
            ctrl, data = _groups(dist.PrefixStore(session, self.store), 0, device)
            with _own_stream(device):
                header = torch.empty(HEADER_LEN, dtype=torch.int64)
                while not self._stop.is_set():
                    ctrl.recv([header], 1, HEADER_TAG).wait()
                    if int(header[0]) < 0:
                        return
                    data.send([self._gather(header)], 1, BLOCKS_TAG).wait()
                    self.num_served += int(header[0])
        except RuntimeError as exc:  # NOTE: the sink went away (a closed connection) or asked outside the pool
            log.info("KV session %s ended: %s", session, exc)

    def _gather(self, header: torch.Tensor) -> torch.Tensor:
        """The heads and blocks a header asks for, contiguous: [num_layers, 2, n, block_size, num_heads, head_dim];
        KVTransferError (ends the session) for heads or blocks outside the pool."""
        n, src_head, num_heads = (int(v) for v in header[:HEADER_FIELDS])
        ids = header[HEADER_FIELDS : HEADER_FIELDS + n]
        _, _, num_blocks, _, pool_heads, _ = self.pool.tensor.shape
        bad_blocks = bool(((ids < 0) | (ids >= num_blocks)).any())
        if not 0 < n <= MAX_BLOCKS_PER_MESSAGE or bad_blocks or not 0 <= src_head < src_head + num_heads <= pool_heads:
            raise KVTransferError(f"a request for {n} blocks of heads [{src_head}, +{num_heads}) of {pool_heads}")
        return heads_of(self.pool.tensor, src_head, num_heads).index_select(2, ids.to(self.pool.device)).contiguous()


def _own_stream(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """A serving thread's CUDA work on a stream of its own (not the worker's), nothing to do on CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    torch.cuda.set_device(device)
    return torch.cuda.stream(torch.cuda.Stream(device))


class _Session(NamedTuple):
    ctrl: Any  # dist.ProcessGroupGloo: headers
    data: Any  # the same group (CPU pools) or a dist.ProcessGroupNCCL (CUDA pools): blocks
    layout: KVLayout


class DistSink(KVTransferSink):
    """Pulls blocks over a process group with each prefill worker's source (see the module docstring)."""

    transport = "dist"

    def __init__(self, local_pool: KVPool, layout: KVLayout) -> None:
        if local_pool.device.type not in ("cpu", "cuda"):
            raise KVTransferError(f"the dist transport copies into CPU and CUDA pools, not {local_pool.device}")
        super().__init__(local_pool, layout)

    def _attach(self, entry: dict[str, Any], remote_layout: KVLayout) -> _Session:
        host, port = descriptor_field(entry, "host", str), descriptor_field(entry, "port", int)
        device = self.local_pool.device
        if descriptor_field(entry, "device_type", str) != device.type:
            raise KVTransferError(f"a {entry['device_type']} pool cannot be pulled into a {device.type} pool")
        session = uuid.uuid4().hex
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT)
            n = store.add(SESSIONS_KEY, 1)
            store.set(f"{SESSIONS_KEY}/{n}", session)
            ctrl, data = _groups(dist.PrefixStore(session, store), 1, device)
        except RuntimeError as exc:
            raise KVTransferError(f"cannot reach the KV source at {host}:{port}: {exc}") from None
        return _Session(ctrl, data, remote_layout)

    def _detach(self, handle: Any) -> None:
        with contextlib.suppress(RuntimeError):  # NOTE: the source may be gone already
            end = torch.zeros(HEADER_LEN, dtype=torch.int64)
            end[0] = -1
            handle.ctrl.send([end], 0, HEADER_TAG).wait()

    def _copy(
        self, remotes: dict[int, Any], segments: tuple[Segment, ...], src_block_ids: list[int], dst_block_ids: list[int]
    ) -> PullHandle:
        for start in range(0, len(src_block_ids), MAX_BLOCKS_PER_MESSAGE):
            src = src_block_ids[start : start + MAX_BLOCKS_PER_MESSAGE]
            dst = torch.tensor(dst_block_ids[start : start + MAX_BLOCKS_PER_MESSAGE], dtype=torch.long)
            self._pull_chunk(remotes, segments, src, dst.to(self.local_pool.device))
        if self.local_pool.device.type != "cuda":
            return PullHandle()
        event = torch.cuda.Event()
        event.record()  # NOTE: after the receives and scatters on the current stream
        return PullHandle(event)

    def _pull_chunk(
        self, remotes: dict[int, _Session], segments: tuple[Segment, ...], src: list[int], dst: torch.Tensor
    ) -> None:
        """Ask each segment's source for its heads of blocks src, then scatter each answer into the segment's heads
        of blocks dst; on CUDA, enqueued on the current stream."""
        try:
            received = [self._request(remotes[s.rank], s, src) for s in segments]
            for s, (work, blocks) in zip(segments, received, strict=True):
                work.wait()  # NOTE: NCCL: the current stream waits, not the host
                s.destination(self.local_pool.tensor).index_copy_(2, dst, blocks)
        except RuntimeError as exc:
            raise KVTransferError(f"KV pull failed: {exc}") from None

    def _request(self, remote: _Session, segment: Segment, src: list[int]) -> tuple[Any, torch.Tensor]:
        """Send the header of one segment's heads of blocks src and post the receive of the answer (before the next
        header: a source answering an earlier one never waits on us); the receive's work and its buffer
        [num_layers, 2, len(src), block_size, segment.num_heads, head_dim]."""
        remote.ctrl.send([_header(src, segment)], 0, HEADER_TAG).wait()
        shape = list(self.layout.shape)
        shape[2], shape[4] = len(src), segment.num_heads
        blocks = torch.empty(shape, dtype=self.layout.torch_dtype, device=self.local_pool.device)
        return remote.data.recv([blocks], 0, BLOCKS_TAG), blocks


def _header(src: list[int], segment: Segment) -> torch.Tensor:
    """[len(src), src_head, num_heads, src...] padded to HEADER_LEN."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:HEADER_FIELDS] = torch.tensor([len(src), segment.src_head, segment.num_heads])
    header[HEADER_FIELDS : HEADER_FIELDS + len(src)] = torch.tensor(src, dtype=torch.int64)
    return header
