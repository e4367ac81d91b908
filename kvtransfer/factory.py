"""Which transport a prefill/decode pair uses, and the source or sink of a transport by name."""

from __future__ import annotations

import torch

from pdserve.kvtransfer.base import TRANSPORTS, KVTransferSink, KVTransferSource
from pdserve.kvtransfer.cuda_ipc import CudaIpcSink, CudaIpcSource
from pdserve.kvtransfer.dist import DistSink, DistSource
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.pool import KVPool
from pdserve.kvtransfer.shm import ShmSink, ShmSource

AUTO = "auto"
"""A cluster's transport choice besides forcing one of TRANSPORTS: each prefill/decode pair picks its own."""


def pair_transport(choice: str, same_host: bool, device: torch.device) -> str:
    """The transport of one prefill/decode pair: `choice` when it forces one; under auto the host-local one
    (cuda_ipc for CUDA pools, shm for CPU ones) within a host, dist across hosts."""
    if choice != AUTO:
        return _check_kind(choice)
    if not same_host:
        return "dist"
    return "cuda_ipc" if device.type == "cuda" else "shm"


def make_source(kind: str, pool: KVPool, host: str = "127.0.0.1") -> KVTransferSource:
    """The source of transport kind ("shm" | "cuda_ipc" | "dist") over pool; host: where a dist source listens."""
    if _check_kind(kind) == "dist":
        return DistSource(pool, host)
    sources: dict[str, type[KVTransferSource]] = {"shm": ShmSource, "cuda_ipc": CudaIpcSource}
    return sources[kind](pool)


def make_sink(kind: str, local_pool: KVPool, layout: KVLayout) -> KVTransferSink:
    """The sink of transport kind ("shm" | "cuda_ipc" | "dist") copying into local_pool (of layout)."""
    sinks: dict[str, type[KVTransferSink]] = {"shm": ShmSink, "cuda_ipc": CudaIpcSink, "dist": DistSink}
    return sinks[_check_kind(kind)](local_pool, layout)


def _check_kind(kind: str) -> str:
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {kind!r}; choose one of {list(TRANSPORTS)}")
    return kind
