"""The KV transfer contract: a source exports a prefill worker's pool, a sink copies blocks out of it.

This is the worker-side half of the connector (it moves bytes); kvtransfer.lease is the scheduler-side
half (which blocks are lent to which decode worker, until when). A worker of TP size N is N ranks, each with
a pool of its own KV heads (kvtransfer.layout); every rank of a decode worker has a sink of its own. The
protocol between the two workers:

1. decode -> prefill `HandshakeCmd(fingerprint)`; the prefill worker runs `check_compatible` and replies
   `HandshakeEvent(descriptor=...)`: the group descriptor, `merge_descriptors` of every rank's
   `source.descriptor()` (a worker of TP size 1 sends its one descriptor as it is).
2. decode, each rank: `sink.open(prefill_worker, descriptor, remote_fingerprint)`, once per prefill worker;
   the sink checks the layouts again, plans head segments (which prefill rank's heads land where in its
   pool: `plan_segments`) and maps the pools of the prefill ranks those segments read (cached until
   `close`).
3. per handed-off request: `handle = sink.pull(prefill_worker, src_block_ids, dst_block_ids)`, one copy per
   segment; once `handle.done()` is True (never before) the request may be scheduled, its destination blocks
   freed or reused, and its lease released (`ReleaseCmd`).

A source announces blocks (HandoffCmd) only after the writes into them have finished; the prefill
worker guarantees it by reading the sampled first token on the host, which waits for the forward pass.
When the pulled bytes are usable: `pull` enqueues the copies and returns a PullHandle without blocking
the host on the GPU:
- shm: the copy is synchronous; the bytes are in the local pool when pull returns and done() is True.
- cuda_ipc: the copies run on the sink's own stream, after the work already queued on the caller's current
  stream of the local pool's device (a step still writing blocks freed before the pull lands first), and
  beside the work enqueued there later: the engine's decode steps go on while a prompt's KV crosses, none
  waits for it. Nothing may read or write the destination blocks until done() is True (or wait() returned).
- dist: the copies run on the caller's current stream (NCCL receives and scatters); done() is True once they
  and the work queued before them have run.
The source blocks are read until done() is True. The lease may be released (ReleaseCmd) only then:
after the release the prefill worker may overwrite or reallocate them. Until then the handle keeps alive
what the copy reads (id tensors, pinned host buffers, the remote pools' mappings).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any, ClassVar, Literal, NamedTuple

import torch

from pdserve.kvtransfer.layout import KVLayout, LayoutMismatchError, check_compatible, kv_head_ranges
from pdserve.kvtransfer.pool import KVPool

Transport = Literal["shm", "cuda_ipc", "dist"]
TRANSPORTS: tuple[Transport, ...] = ("shm", "cuda_ipc", "dist")


class KVTransferError(RuntimeError):
    """A descriptor that cannot be opened, a prefill worker not opened, or block ids out of range."""


class KVTransferSource(ABC):
    """Prefill side, one per rank: exports its pool (the pool stays owned by the worker; the source never
    frees it)."""

    transport: ClassVar[Transport]

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def fingerprint(self) -> dict[str, Any]:
        """The pool's layout fingerprint (everything but num_blocks and the rank)."""
        return self.pool.layout.fingerprint()

    def descriptor(self) -> dict[str, Any]:
        """What a sink needs to open the pool, as plain msgpack-able values: a group descriptor of this rank
        alone, {transport, fingerprint, ranks: [{tp_rank, num_blocks, shape, **the transport's own fields}]}
        (shm name, CUDA IPC handle, or dist address). merge_descriptors joins those of a worker's ranks."""
        layout = self.pool.layout
        rank = {"tp_rank": layout.tp_rank, "num_blocks": layout.num_blocks, "shape": list(layout.shape)}
        return {"transport": self.transport, "fingerprint": layout.fingerprint(), "ranks": [{**rank, **self._export()}]}

    @abstractmethod
    def _export(self) -> dict[str, Any]:
        """The transport's fields of this rank's descriptor entry."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop serving sinks (default: nothing runs on the source's side)."""


def merge_descriptors(descriptors: list[dict[str, Any]]) -> dict[str, Any]:
    """The group descriptor of a prefill worker: its ranks' descriptors (any order) joined, ranks sorted by
    tp_rank. KVTransferError unless they share transport and fingerprint and hold each rank 0..tp_size-1 once."""
    if not descriptors:
        raise KVTransferError("no descriptors to merge")
    first = descriptors[0]
    for other in descriptors[1:]:
        for name in ("transport", "fingerprint"):
            if other.get(name) != first.get(name):
                raise KVTransferError(f"rank descriptors differ in {name}: {first.get(name)!r} vs {other.get(name)!r}")
    ranks = [rank for d in descriptors for rank in descriptor_field(d, "ranks", list)]
    merged = {"transport": first.get("transport"), "fingerprint": descriptor_field(first, "fingerprint", dict)}
    return {**merged, "ranks": _sorted_ranks(ranks, merged["fingerprint"])}


def _sorted_ranks(ranks: list[Any], fingerprint: dict[str, Any]) -> list[dict[str, Any]]:
    """ranks sorted by tp_rank; KVTransferError unless they are exactly 0..tp_size-1 of the fingerprint."""
    for rank in ranks:
        if not isinstance(rank, dict):
            raise KVTransferError(f"descriptor rank entry {rank!r} is not a mapping")
        descriptor_field(rank, "tp_rank", int)
    tp_size = fingerprint.get("tp_size", 1)
    found = sorted(rank["tp_rank"] for rank in ranks)
    if not isinstance(tp_size, int) or found != list(range(tp_size)):
        raise KVTransferError(f"descriptor ranks {found} are not each rank of TP size {tp_size!r} once")
    return sorted(ranks, key=lambda rank: rank["tp_rank"])


class Segment(NamedTuple):
    """A run of KV heads one pull copies from one remote rank: heads [src_head, src_head + num_heads) of that
    rank's pool land in heads [dst_head, dst_head + num_heads) of the local pool (offsets in each pool)."""

    rank: int
    src_head: int
    dst_head: int
    num_heads: int

    def source(self, remote: torch.Tensor) -> torch.Tensor:
        """The segment's heads of a remote rank's pool (a view)."""
        return heads_of(remote, self.src_head, self.num_heads)

    def destination(self, local: torch.Tensor) -> torch.Tensor:
        """The segment's heads of the local pool (a view: writes into it land in the pool)."""
        return heads_of(local, self.dst_head, self.num_heads)


def heads_of(pool: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Heads [first, first + count) of every block of a pool [num_layers, 2, num_blocks, block_size, heads, head_dim]
    (a view)."""
    return pool[:, :, :, :, first : first + count]


def plan_segments(local: KVLayout, remote_ranges: list[tuple[int, int]]) -> tuple[Segment, ...]:
    """The segments that fill every head of local's pool from a group holding remote_ranges ((first, count)
    per remote rank). Each head comes from the remote rank of local's tp_rank when that rank holds it (equal
    TP sizes pull rank r from rank r), else from the lowest rank holding it; runs of consecutive heads from
    one rank are one segment. LayoutMismatchError for a head no remote rank holds."""
    first, count = local.heads
    segments: list[Segment] = []
    for dst_head, head in enumerate(range(first, first + count)):
        rank = _owner(head, local.tp_rank, remote_ranges)
        last = segments[-1] if segments else None
        if last is not None and last.rank == rank:
            segments[-1] = last._replace(num_heads=last.num_heads + 1)
        else:
            segments.append(Segment(rank, head - remote_ranges[rank][0], dst_head, 1))
    return tuple(segments)


def _owner(head: int, preferred: int, ranges: list[tuple[int, int]]) -> int:
    holders = [rank for rank, (first, count) in enumerate(ranges) if first <= head < first + count]
    if not holders:
        raise LayoutMismatchError(f"KV head {head} is held by no remote rank ({ranges})")
    return preferred if preferred in holders else holders[0]


class PullHandle:
    """The completion of one pull: done() once the copy has finished (at once for a synchronous copy).

    Until then it holds what the copy reads (freeing a pinned id buffer or unmapping the remote pool
    under a queued copy would corrupt it); both are dropped once the copy is seen done.
    """

    def __init__(self, event: torch.cuda.Event | None = None, keep_alive: tuple[torch.Tensor, ...] = ()) -> None:
        self._event = event  # recorded on the sink's stream after the copy; None: nothing in flight
        self._keep_alive = keep_alive

    def done(self) -> bool:
        """Whether the copy has finished; never blocks (queries the copy's event)."""
        if self._event is not None and not self._event.query():
            return False
        self._finish()
        return True

    def wait(self) -> None:
        """Block the host until the copy has finished (shutdown paths; the serving loop polls done())."""
        if self._event is not None:
            self._event.synchronize()
        self._finish()

    def _finish(self) -> None:
        self._event = None
        self._keep_alive = ()


class _RemoteRank(NamedTuple):
    layout: KVLayout
    handle: Any
    """What _attach returned: the mapped pool of one remote rank [num_layers, 2, its num_blocks, block_size,
    its heads, head_dim] (shm, cuda_ipc), or a connection to its source (dist)."""


class _Remote(NamedTuple):
    descriptor: dict[str, Any]
    segments: tuple[Segment, ...]
    ranks: dict[int, _RemoteRank]
    """The remote ranks the segments read, by tp_rank."""


class KVTransferSink(ABC):
    """Decode side, one per rank: opens prefill workers' pools (once each) and copies blocks, this rank's KV
    heads of them, into the local pool."""

    transport: ClassVar[Transport]

    def __init__(self, local_pool: KVPool, layout: KVLayout) -> None:
        if tuple(local_pool.tensor.shape) != layout.shape or local_pool.tensor.dtype != layout.torch_dtype:
            raise ValueError(
                f"local pool {tuple(local_pool.tensor.shape)} {local_pool.tensor.dtype} does not match "
                f"layout {layout.shape} {layout.dtype}"
            )
        self.local_pool = local_pool
        self.layout = layout
        self._remotes: dict[int, _Remote] = {}

    def is_open(self, prefill_worker: int) -> bool:
        return prefill_worker in self._remotes

    def open(
        self, prefill_worker: int, descriptor: dict[str, Any], remote_fingerprint: dict[str, Any] | None = None
    ) -> None:
        """Map prefill_worker's pools described by descriptor (its group descriptor, see merge_descriptors):
        those of the ranks holding this rank's KV heads, one mapping per rank.

        Raises LayoutMismatchError when remote_fingerprint (if given) or the fingerprint inside the
        descriptor is incompatible with ours, KVTransferError for a descriptor of another transport or one that
        cannot be opened. Opening the same descriptor again is a no-op; a different one replaces the old.
        """
        if descriptor.get("transport") != self.transport:
            raise KVTransferError(f"{self.transport} sink got a {descriptor.get('transport')!r} descriptor")
        local_fp = self.layout.fingerprint()
        if remote_fingerprint is not None:
            check_compatible(local_fp, remote_fingerprint)
        remote_fp = descriptor_field(descriptor, "fingerprint", dict)
        check_compatible(local_fp, remote_fp)
        current = self._remotes.get(prefill_worker)
        if current is not None and current.descriptor == descriptor:
            return
        self.close(prefill_worker)
        segments = plan_segments(self.layout, kv_head_ranges(remote_fp))
        entries = _sorted_ranks(descriptor_field(descriptor, "ranks", list), remote_fp)
        ranks: dict[int, _RemoteRank] = {}
        try:
            for rank in sorted({s.rank for s in segments}):
                layout = self._remote_layout(entries[rank], remote_fp)
                ranks[rank] = _RemoteRank(layout, self._attach(entries[rank], layout))
        except BaseException:
            for opened in ranks.values():
                self._detach(opened.handle)
            raise
        self._remotes[prefill_worker] = _Remote(dict(descriptor), segments, ranks)

    @torch.inference_mode()
    def pull(self, prefill_worker: int, src_block_ids: list[int], dst_block_ids: list[int]) -> PullHandle:
        """Copy blocks src_block_ids of prefill_worker's pools into dst_block_ids of the local pool: K and V of
        every layer, this rank's KV heads, one copy per head segment. Returns once the copies are enqueued (see
        the module's docstring); the destination blocks may be used and the lease released once the handle is
        done(). KVTransferError when prefill_worker is not open or the ids are out
        of range, of different lengths, or repeat a destination (nothing is copied then)."""
        remote = self._remotes.get(prefill_worker)
        if remote is None:
            raise KVTransferError(f"prefill worker {prefill_worker} is not open")
        num_src_blocks = min(rank.layout.num_blocks for rank in remote.ranks.values())
        _check_block_ids(src_block_ids, dst_block_ids, num_src_blocks, self.layout.num_blocks)
        if not src_block_ids:
            return PullHandle()
        handles = {rank: opened.handle for rank, opened in remote.ranks.items()}
        return self._copy(handles, remote.segments, src_block_ids, dst_block_ids)

    def close(self, prefill_worker: int) -> None:
        """Drop the mappings of prefill_worker's pools (no-op if not open)."""
        remote = self._remotes.pop(prefill_worker, None)
        if remote is not None:
            for opened in remote.ranks.values():
                self._detach(opened.handle)

    def close_all(self) -> None:
        for prefill_worker in list(self._remotes):
            self.close(prefill_worker)

    def _remote_layout(self, entry: dict[str, Any], remote_fp: dict[str, Any]) -> KVLayout:
        """The layout of the remote rank `entry` describes, checked against the ranges of its fingerprint."""
        rank, num_blocks = entry["tp_rank"], descriptor_field(entry, "num_blocks", int)
        try:
            layout = replace(self.layout, num_blocks=num_blocks, tp_size=remote_fp.get("tp_size", 1), tp_rank=rank)
        except ValueError as exc:
            raise KVTransferError(f"bad descriptor: {exc}") from None
        heads = kv_head_ranges(remote_fp)[rank]
        if layout.heads != heads:  # both sides split heads with core.parallel.kv_head_range
            raise KVTransferError(f"remote rank {rank} holds KV heads {heads}, TP rank {rank} here {layout.heads}")
        shape = tuple(descriptor_field(entry, "shape", list))
        if shape != layout.shape:
            raise KVTransferError(f"descriptor shape {shape} != {layout.shape} implied by its fingerprint")
        return layout

    @abstractmethod
    def _attach(self, entry: dict[str, Any], remote_layout: KVLayout) -> Any:
        """Map the pool of the remote rank `entry` describes (a tensor of remote_layout's shape and dtype) or
        connect to its source."""

    def _detach(self, handle: Any) -> None:  # noqa: B027 - optional hook
        """Let go of what _attach returned (default: nothing to do beyond dropping it)."""

    @abstractmethod
    def _copy(
        self, remotes: dict[int, Any], segments: tuple[Segment, ...], src_block_ids: list[int], dst_block_ids: list[int]
    ) -> PullHandle:
        """For each segment s: local[:, :, dst, :, s.dst_head:+s.num_heads] = remotes[s.rank][:, :, src, :,
        s.src_head:+s.num_heads] (ids already checked): done, or enqueued, on return; the handle tells when both
        the source and the destination blocks are no longer touched."""


def descriptor_field(descriptor: dict[str, Any], name: str, kind: type) -> Any:
    """descriptor[name], which must be a kind (bool is not an int here); else KVTransferError."""
    value = descriptor.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise KVTransferError(f"descriptor field {name!r} is {value!r}, expected {kind.__name__}")
    return value


def _check_block_ids(src: list[int], dst: list[int], num_src_blocks: int, num_dst_blocks: int) -> None:
    if len(src) != len(dst):
        raise KVTransferError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    bad_src = [b for b in src if not 0 <= b < num_src_blocks]
    bad_dst = [b for b in dst if not 0 <= b < num_dst_blocks]
    if bad_src or bad_dst:
        raise KVTransferError(f"block ids out of range: source {bad_src[:8]}, destination {bad_dst[:8]}")
    if len(set(dst)) != len(dst):
        raise KVTransferError("destination block ids repeat")
