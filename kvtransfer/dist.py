"""Cross-host transport: KV blocks travel over torch.distributed point-to-point on one two-rank process group
per prefill/decode pair: gloo for CPU pools, NCCL for CUDA pools (request headers always go over gloo). No
hand-written sockets carry KV bytes.

Neither side can read the other's memory, so a pull is a request the source answers:
- The source hosts a TCPStore (its address is in the descriptor's one rank entry) and a daemon thread that
  watches it for new sessions; each sink that opens the pool registers a session id there and joins a fresh
  gloo group (rank 1) under that prefix, plus an NCCL group for a CUDA pool; the source's thread joins them as
  rank 0 and serves them from its own thread (on its own CUDA stream).
- pull: the sink sends a header [n, src ids...] (gloo, tag 0), the source gathers those blocks of its pool
  and sends them as one tensor (tag 1), the sink scatters them into its pool. CPU: synchronous, the handle is
  done on return, so the lease is released as with shm. CUDA: the receive and the scatter are enqueued on the
  sink's current stream without blocking the host; the handle's event completes after them, and the source
  has sent every byte by then, so the lease is released as with cuda_ipc. A header with n = -1 ends the
  session.
NOTE: both workers must be of TP size 1 (a sink refuses any other open): a pull moves whole blocks of the one
pool on each side, and the source serves no head slices.
NOTE: the serving thread reads leased blocks only (the prefill worker never writes a leased block), so it
needs no lock with the worker's loop.
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
)
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.pool import KVPool

log = logging.getLogger(__name__)
TIMEOUT = datetime.timedelta(seconds=30)
HEADER_LEN = 1 + 1024
"""Request header: [n, up to 1024 block ids] (padded)."""
MAX_BLOCKS_PER_MESSAGE = HEADER_LEN - 1
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
                    n = int(header[0])
                    if n < 0:
                        return
                    ids = header[1 : 1 + n].to(device)
                    blocks = self.pool.tensor.index_select(2, ids)  # [L, 2, n, block, heads, dim]
                    data.send([blocks], 1, BLOCKS_TAG).wait()
                    self.num_served += n
        except RuntimeError as exc:  # NOTE: the sink went away (gloo or NCCL report a closed connection)
            log.info("KV session %s ended: %s", session, exc)


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

    def open(
        self, prefill_worker: int, descriptor: dict[str, Any], remote_fingerprint: dict[str, Any] | None = None
    ) -> None:
        """KVTransferSink.open, refused (KVTransferError) unless both workers are of TP size 1."""
        sizes = [_tp_size(fp) for fp in (descriptor.get("fingerprint"), remote_fingerprint)]
        local, remote = self.layout.tp_size, next((size for size in sizes if size != 1), 1)
        if local != 1 or remote != 1:
            sizes_text = f"decode TP {local}, prefill TP {remote}"
            raise KVTransferError(f"the dist transport moves KV between workers of TP size 1 only ({sizes_text})")
        super().open(prefill_worker, descriptor, remote_fingerprint)

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
        (remote,) = remotes.values()  # NOTE: TP size 1 on both sides: one segment, every head of both pools
        for start in range(0, len(src_block_ids), MAX_BLOCKS_PER_MESSAGE):
            src = src_block_ids[start : start + MAX_BLOCKS_PER_MESSAGE]
            dst = torch.tensor(dst_block_ids[start : start + MAX_BLOCKS_PER_MESSAGE], dtype=torch.long)
            self._pull_chunk(remote, src, dst)
        if self.local_pool.device.type != "cuda":
            return PullHandle()
        event = torch.cuda.Event()
        event.record()  # NOTE: after the receives and scatters on the current stream
        return PullHandle(event)

    def _pull_chunk(self, remote: _Session, src: list[int], dst: torch.Tensor) -> None:
        """Ask for blocks src and scatter them into dst; on CUDA, enqueued on the current stream."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0] = len(src)
        header[1 : 1 + len(src)] = torch.tensor(src, dtype=torch.int64)
        shape = list(self.layout.shape)
        shape[2] = len(src)
        device = self.local_pool.device
        blocks = torch.empty(shape, dtype=self.layout.torch_dtype, device=device)
        try:
            remote.ctrl.send([header], 0, HEADER_TAG).wait()
            remote.data.recv([blocks], 0, BLOCKS_TAG).wait()  # NOTE: NCCL: the current stream waits, not the host
        except RuntimeError as exc:
            raise KVTransferError(f"KV pull failed: {exc}") from None
        self.local_pool.tensor.index_copy_(2, dst.to(device), blocks)


def _tp_size(fingerprint: Any) -> Any:
    """The TP size a fingerprint names (1 when it names none, or is no mapping: the base checks refuse those)."""
    return fingerprint.get("tp_size", 1) if isinstance(fingerprint, dict) else 1
