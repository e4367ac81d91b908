"""The layouts the planner compares at one GPU count, and the pdserve-cluster flags that start each.

- colocated-cC: one worker per GPU prefilling its own requests in chunks of C tokens beside its decodes (a small
  C keeps decode steps short: TPOT; a large one finishes prompts sooner: TTFT).
- pP:dD: p prefill and d decode workers, one GPU each (p + d = GPUs).
- pP:dD-shared: p + d = GPUs + 1, the last prefill worker and the first decode worker share a GPU under an MPS
  split of its SMs (on 2 GPUs: 2P:1D-shared and 1P:2D-shared; on 1 GPU: 1P:1D-shared). pdserve-cluster gives
  the split's share to every worker of a role, so then a worker alone on its GPU runs on that share too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["colocated", "disaggregated"]
DEFAULT_CHUNKS = (512, 2048)
"""Colocated chunk sizes compared: one that favours TPOT, one that favours TTFT."""


@dataclass(frozen=True)
class WorkerSlot:
    """One worker process and the share of its GPU it gets."""

    gpu: int
    """The GPU it runs on."""
    sm_share: float = 1.0
    """Its MPS share of the GPU's SMs (1: the GPU alone)."""
    kv_share: float = 1.0
    """Its share of the KV memory a worker alone on the GPU has (1/2 where two workers share it)."""


@dataclass(frozen=True)
class Layout:
    """Which workers run where."""

    name: str
    kind: Kind
    num_gpus: int
    prefill: tuple[WorkerSlot, ...]
    """Prefill workers (none when colocated)."""
    decode: tuple[WorkerSlot, ...]
    """Decode workers (colocated: the workers doing both)."""
    chunk: int | None = None
    """Colocated: prefill chunk and step token budget."""
    mps_split: tuple[int, int] | None = None
    """Percent of a shared GPU's SMs for (prefill, decode); None: no GPU is shared."""

    def cluster_flags(self, max_num_seqs: int) -> list[str]:
        """pdserve-cluster flags that start this layout (placement, MPS split, batching limits)."""
        flags = ["--max-num-seqs", str(max_num_seqs)]
        decode_gpus = ",".join(str(w.gpu) for w in self.decode)
        if self.kind == "colocated":
            assert self.chunk is not None
            flags += ["--colocated", "--decode", str(len(self.decode)), "--decode-gpus", decode_gpus]
            return flags + ["--max-num-batched-tokens", str(self.chunk), "--prefill-chunk-size", str(self.chunk)]
        prefill_gpus = ",".join(str(w.gpu) for w in self.prefill)
        flags += ["--prefill", str(len(self.prefill)), "--decode", str(len(self.decode))]
        flags += ["--prefill-gpus", prefill_gpus, "--decode-gpus", decode_gpus]
        if self.mps_split is not None:
            flags += ["--mps-split", f"{self.mps_split[0]}/{self.mps_split[1]}"]
        return flags


def colocated(num_gpus: int, chunk: int) -> Layout:
    workers = tuple(WorkerSlot(g) for g in range(num_gpus))
    return Layout(f"colocated-c{chunk}", "colocated", num_gpus, (), workers, chunk=chunk)


def disaggregated(num_prefill: int, num_decode: int, num_gpus: int, mps_split: tuple[int, int]) -> Layout:
    """p prefill then d decode workers over the GPUs in order; when p + d = GPUs + 1 the last prefill worker and
    the first decode worker share GPU p - 1 under mps_split."""
    shared = num_prefill + num_decode == num_gpus + 1
    prefill = [WorkerSlot(g) for g in range(num_prefill)]
    first_decode = num_prefill - 1 if shared else num_prefill
    decode = [WorkerSlot(first_decode + j) for j in range(num_decode)]
    if shared:  # only the two workers on GPU p - 1 split it (placement.Mps: a worker alone keeps the whole GPU)
        prefill[-1] = WorkerSlot(prefill[-1].gpu, mps_split[0] / 100)
        decode[0] = WorkerSlot(decode[0].gpu, mps_split[1] / 100, 0.5)
    name = f"{num_prefill}P:{num_decode}D" + ("-shared" if shared else "")
    return Layout(name, "disaggregated", num_gpus, tuple(prefill), tuple(decode), None, mps_split if shared else None)


def layouts_for(
    num_gpus: int, chunks: tuple[int, ...] = DEFAULT_CHUNKS, mps_split: tuple[int, int] = (50, 50)
) -> list[Layout]:
    """Every layout the planner compares on num_gpus GPUs (module docstring)."""
    if num_gpus < 1:
        raise ValueError("num_gpus must be >= 1")
    out = [colocated(num_gpus, c) for c in chunks]
    out += [disaggregated(p, num_gpus - p, num_gpus, mps_split) for p in range(1, num_gpus)]
    out += [disaggregated(p, num_gpus + 1 - p, num_gpus, mps_split) for p in range(1, num_gpus + 1)]
    return out
