"""Tensor parallelism inside one worker: its ranks' process group, which slice of each sharded dimension a rank
holds, and the two collectives the sharded layers call (core/models/layers.py).

A worker of TP size N is N processes, one per GPU (or N CPU processes, gloo), each holding 1/N of the query
heads, of the KV heads (each KV head replicated N / num_kv_heads times where N exceeds them, as vLLM does), of
the MLP width and of the vocabulary. Megatron's split: column-parallel q/k/v and gate/up need no
communication, row-parallel o/down end in one all-reduce each, the embedding lookup is an all-reduce of masked
rows and the logits an all-gather. At size 1 nothing here touches torch.distributed.

On CUDA, decode-sized messages (up to max_num_seqs rows of the hidden size) avoid NCCL: a sum that an RMSNorm
follows runs fused with the residual add and the norm in one kernel (FusedAllReduceNorm, kernels/allreduce_norm.py),
other sums take torch's one-shot all-reduce (OneShotAllReduce); both read the peers' symmetric-memory buffers
over NVLink. Larger messages, other ops and gloo take torch.distributed.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist

from pdserve.kernels.allreduce_norm import PROGRAMS, SLOTS, PeerRows, all_reduce_rms_norm, fill_sentinel, triton
from pdserve.kernels.triton_utils import use_pdl

log = logging.getLogger(__name__)


AllReduceKind = Literal["fused", "one_shot", "nccl"]


@dataclass(frozen=True)
class ParallelConfig:
    """This process's place in its worker's TP group."""

    tp_size: int = 1
    """Processes of the group."""
    tp_rank: int = 0
    """This process's rank in [0, tp_size); rank 0 schedules."""
    all_reduce: AllReduceKind = "fused"
    """On CUDA, decode-sized sums: "fused" (FusedAllReduceNorm where a norm follows, else OneShotAllReduce),
    "one_shot" (OneShotAllReduce, then the norm) or "nccl" (NCCL for every message)."""

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"TP rank {self.tp_rank} of size {self.tp_size}: need 0 <= rank < size")


class Shard(NamedTuple):
    """Which part of a checkpoint tensor a parameter (or one part of a merged one) holds: along dim, the
    `length` entries from `start` of a dimension of `full` entries."""

    dim: int
    start: int
    length: int
    full: int


def even_split(full: int, size: int, rank: int, what: str) -> tuple[int, int]:
    """(start, length) of rank's equal share of full entries; ValueError naming what when size does not divide."""
    if full % size:
        raise ValueError(f"{what} ({full}) is not divisible by the TP size {size}")
    length = full // size
    return rank * length, length


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """(first KV head, KV heads) of rank: an equal share, or one head replicated on size / num_kv_heads ranks."""
    if size <= num_kv_heads:
        return even_split(num_kv_heads, size, rank, "num_key_value_heads")
    if size % num_kv_heads:
        raise ValueError(f"TP size {size} is neither a divisor nor a multiple of num_key_value_heads {num_kv_heads}")
    return rank // (size // num_kv_heads), 1


ALIGN = 16
"""Bytes: the one-shot kernel's vectorized loads need the message's start and size aligned."""


class OneShotAllReduce:
    """torch's one-shot all-reduce (torch.ops.symm_mem) over one symmetric buffer of `numel` elements per rank,
    mapped into every peer at rendezvous. A call copies x into this rank's buffer; the kernel waits on every
    peer's copy (signal pads), sums the peers' buffers read over NVLink (no multicast) into x and waits again,
    so the next call may rewrite the buffer at once: in-place, allocation-free and capturable in a CUDA graph."""

    def __init__(self, group: dist.ProcessGroup, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
            raise RuntimeError(f"torch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce_out")
        self.group_name: str = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # NOTE: older torch needs it, newer deprecates it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(numel, dtype=dtype, device=device)  # [numel]
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self(torch.zeros(ALIGN, dtype=dtype, device=device))  # NOTE: a dtype the kernel lacks fails here, on every rank

    def fits(self, x: torch.Tensor) -> bool:
        """x is a message the kernel takes: CUDA, the buffer's dtype, no larger, contiguous and 16-byte aligned."""
        if not x.is_cuda or x.dtype != self.buffer.dtype or x.numel() > self.buffer.numel() or not x.is_contiguous():
            return False
        return (x.numel() * x.element_size()) % ALIGN == 0 and x.data_ptr() % ALIGN == 0

    def __call__(self, x: torch.Tensor) -> None:
        n, flat = x.numel(), x.view(-1)
        self.buffer[:n].copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(self.buffer[:n], "sum", self.group_name, flat)


class FusedAllReduceNorm:
    """The sum over the group of a [rows, hidden] partial output fused with the residual add and RMSNorm after it
    (kernels/allreduce_norm.py: the memory it maps, the protocol): one launch, allocation-free apart from its two
    outputs (fixed-size per pass, so capturable in CUDA graphs). Every rank must make the same calls in the same
    order, which the group's ranks do: they run the same passes."""

    def __init__(self, group: dist.ProcessGroup, rank: int, rows: int, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        import torch.distributed._symmetric_memory as symm_mem

        if triton is None:
            raise RuntimeError("the fused all-reduce + RMSNorm needs triton")
        self.rank, self.rows, self.hidden, self.dtype = rank, rows, hidden, dtype
        size = dist.get_world_size(group)
        buffer = symm_mem.empty(SLOTS * size * rows * hidden, dtype=dtype, device=device)  # [SLOTS, size, rows, hidden]
        fill_sentinel(buffer)
        torch.cuda.synchronize(device)  # NOTE: every element the sentinel before the rendezvous lets a peer write
        self.buffer, handle = buffer, symm_mem.rendezvous(buffer, group.group_name)
        self.buffer_ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)  # [size]
        self.slot_rows = torch.zeros(SLOTS, dtype=torch.int32, device=device)  # [SLOTS]
        self.epochs = torch.ones(PROGRAMS, dtype=torch.int32, device=device)  # [PROGRAMS]
        self.peer_rows = PeerRows(self.buffer_ptrs, self.epochs, rows, rank)
        """Where a one-row producer writes its partial output for the next call (kernels/gemv.py)."""

    def fits(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """x, residual and weight are what the kernel takes: CUDA, rows contiguous, the buffer's dtype and width,
        no more rows."""
        rows, hidden = x.shape
        same = (t.dtype == self.dtype and t.is_cuda and t.is_contiguous() for t in (x, residual, weight))
        return all(same) and hidden == self.hidden and rows <= self.rows and residual.shape == x.shape

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, pushed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return all_reduce_rms_norm(
            x, residual, weight, eps, self.buffer_ptrs, self.slot_rows, self.epochs, self.rows, self.rank, pushed,
            use_pdl(x),
        )  # fmt: skip


class TPGroup:
    """The collectives of this process's TP group; the identity at size 1."""

    def __init__(self, rank: int = 0, size: int = 1, group: dist.ProcessGroup | None = None) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.one_shot: OneShotAllReduce | None = None
        """Sums the messages it fits (use_symmetric_memory); None: NCCL / gloo for all."""
        self.fused_norm: FusedAllReduceNorm | None = None
        """Sums then normalizes the messages it fits (use_symmetric_memory); None: the sum, then the norm."""
        self.pushed: torch.Tensor | None = None
        """The one-row partial output a GEMV last wrote into the peers' buffers (push_target), until the fused sum
        that follows it consumes it."""

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """The sum (or op) of x over the ranks, in place."""
        if self.size == 1:
            return x
        if self.one_shot is not None and op == dist.ReduceOp.SUM and self.one_shot.fits(x):
            self.one_shot(x)
        else:
            dist.all_reduce(x, op=op, group=self.group)
        return x

    def push_target(self, rows: int, hidden: int, dtype: torch.dtype) -> PeerRows | None:
        """Where a row-parallel GEMV may write its partial output of `rows` x `hidden` for the fused sum after it
        (then note_pushed): one row the fused sum takes; None: it must not."""
        fused = self.fused_norm
        if fused is None or rows != 1 or hidden != fused.hidden or dtype != fused.dtype:
            return None
        if self.pushed is not None:
            raise RuntimeError("TP group: a partial output written into the peers' buffers was never summed")
        return fused.peer_rows

    def note_pushed(self, x: torch.Tensor) -> None:
        """x went into the peers' buffers (push_target): the next all_reduce_rms_norm, of x, must not send it again."""
        self.pushed = x

    def all_reduce_rms_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: this rank's partial sums
        residual: torch.Tensor,  # [num_tokens, hidden]
        weight: torch.Tensor,  # [hidden]
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum of x over the ranks + residual), that sum + residual): one fused kernel where it fits,
        else the all-reduce and then kernels/fused_ops.py's rms_norm (x is summed in place then)."""
        pushed, self.pushed = self.pushed, None
        if pushed is not None and pushed is not x:
            raise RuntimeError("TP group: the sum after a pushed partial output must be of that output")
        if self.fused_norm is not None and self.fused_norm.fits(x, residual, weight):
            return self.fused_norm(x, residual, weight, eps, pushed is not None)
        if pushed is not None:
            raise RuntimeError("TP group: a partial output went into the peers' buffers but its sum does not fit")
        from pdserve.kernels.fused_ops import rms_norm

        return rms_norm(self.all_reduce(x), weight, eps, residual)

    def use_symmetric_memory(self, kind: AllReduceKind, rows: int, hidden: int, dtype: torch.dtype,
                             device: torch.device) -> bool:  # fmt: skip
        """From now on, sum CUDA messages of up to rows x hidden elements of dtype over symmetric memory: every
        sum with OneShotAllReduce, and with kind "fused" the sums a norm follows with FusedAllReduceNorm; when every
        rank can (they agree: a rank on NCCL and one on the symmetric buffers would wait on each other forever).
        Whether on. Call before capturing CUDA graphs, on every rank alike."""
        if self.size == 1 or device.type != "cuda" or kind == "nccl":
            return False
        try:
            one_shot: OneShotAllReduce | None = OneShotAllReduce(self.group, rows * hidden, dtype, device)  # type: ignore[arg-type]
            fused = FusedAllReduceNorm(self.group, self.rank, rows, hidden, dtype, device) if kind == "fused" else None  # type: ignore[arg-type]
        except Exception as exc:  # NOTE: no P2P access, no symm_mem op in this torch build, ...
            log.warning("TP rank %d: symmetric-memory all-reduce unavailable, NCCL for all (%s: %s)", self.rank,
                        type(exc).__name__, exc)  # fmt: skip
            one_shot, fused = None, None
        ready = one_shot is not None and (kind != "fused" or fused is not None)
        everyone = torch.tensor([ready], dtype=torch.int32, device=device)
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=self.group)
        on = bool(everyone.item())
        self.one_shot, self.fused_norm = (one_shot, fused) if on else (None, None)
        return on

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # [n, d] -> [n, size * d], rank order
        """Every rank's x side by side along the last dim."""
        if self.size == 1:
            return x
        if x.is_cuda:
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
            parts = list(out.unbind(0))
        else:  # NOTE: gloo has no all_gather_into_tensor
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


_GROUP = TPGroup()
GROUP_TIMEOUT = timedelta(seconds=60)
"""How long a rank waits for the others at start-up and in a collective before it fails."""


def tp_group() -> TPGroup:
    """This process's TP group (size 1 until init_tp_group)."""
    return _GROUP


def init_tp_group(cfg: ParallelConfig, init_method: str, device: torch.device) -> TPGroup:
    """Join the worker's group (NCCL on CUDA, gloo on CPU) as cfg.tp_rank; a no-op at size 1.

    NOTE: init_method is a file:// or tcp://127.0.0.1 rendezvous private to the worker's ranks.
    """
    global _GROUP
    if cfg.tp_size == 1:
        _GROUP = TPGroup()
        return _GROUP
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NOTE: NCCL's communicator binds to the current device
    dist.init_process_group(
        backend, init_method=init_method, world_size=cfg.tp_size, rank=cfg.tp_rank, timeout=GROUP_TIMEOUT
    )
    _GROUP = TPGroup(cfg.tp_rank, cfg.tp_size, dist.group.WORLD)
    # NOTE: NCCL makes its communicator at the first collective, which must not be one a CUDA graph captures
    _GROUP.all_reduce(torch.zeros(1, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return _GROUP


def close_tp_group() -> None:
    """Leave the group before the process exits: gloo's threads must not outlive it (an abort otherwise).

    NOTE: an NCCL group whose collectives CUDA graphs captured hangs in destroy_process_group (torch 2.11,
    H200); its communicator goes with the process.
    """
    global _GROUP
    if _GROUP.size > 1 and dist.get_backend(_GROUP.group) == "gloo":
        dist.destroy_process_group()
    _GROUP = TPGroup()
