"""The layouts the planner compares at one GPU count, and the pdserve-cluster flags that start each. A worker is a
TP group: one GPU at TP 1, t consecutive GPUs at TP t (its ranks, in order).

- colocated-cC: one worker per GPU prefilling its own requests in chunks of C tokens beside its decodes (a small
  C keeps decode steps short: TPOT; a large one finishes prompts sooner: TTFT).
- pP:dD: p prefill and d decode workers, one GPU each (p + d = GPUs).
- pP:dD-shared: p + d = GPUs + 1, the last prefill worker and the first decode worker share a GPU under an MPS
  split of its SMs (on 2 GPUs: 2P:1D-shared and 1P:2D-shared; on 1 GPU: 1P:1D-shared). Only those two get their
  role's share (placement.alone_on_their_gpus): a worker alone on its GPU keeps all of it.
- With TP sizes t > 1 (those the profile has): colocated-tpT-cC, GPUs / t colocated workers of TP t; pP(tpA):dD(tpB)
  (a TP size 1 unwritten), p prefill workers of TP a then d decode workers of TP b, p * a + d * b = GPUs; and
  1P(tpN):1D(tpN)-shared on N GPUs, a prefill and a decode worker of TP N on all of them under the MPS split.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

Kind = Literal["colocated", "disaggregated"]
DEFAULT_CHUNKS = (512, 2048)
"""Colocated chunk sizes compared: one that favours TPOT, one that favours TTFT."""


@dataclass(frozen=True)
class WorkerSlot:
    """One worker process group (its TP ranks) and the share of its GPUs it gets."""

    gpus: tuple[int, ...]
    """The GPUs its ranks run on, rank r on the r-th."""
    sm_share: float = 1.0
    """Its MPS share of the GPUs' SMs (1: the GPUs alone)."""
    kv_share: float = 1.0
    """Its share of the KV memory a worker alone on the GPUs has (1/2 where two workers share them)."""

    @property
    def tp_size(self) -> int:
        return len(self.gpus)


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

    @property
    def prefill_tp(self) -> int:
        """TP size of every prefill worker (1 when colocated: none)."""
        return self.prefill[0].tp_size if self.prefill else 1

    @property
    def decode_tp(self) -> int:
        """TP size of every decode (or colocated) worker."""
        return self.decode[0].tp_size

    def cluster_flags(self, max_num_seqs: int) -> list[str]:
        """pdserve-cluster flags that start this layout (placement, TP sizes, MPS split, batching limits)."""
        flags = ["--max-num-seqs", str(max_num_seqs)]
        if self.kind == "colocated":
            assert self.chunk is not None
            flags += ["--colocated", "--decode", str(len(self.decode)), "--decode-gpus", gpu_list(self.decode)]
            flags += ["--tp", str(self.decode_tp)] if self.decode_tp > 1 else []
            return flags + ["--max-num-batched-tokens", str(self.chunk), "--prefill-chunk-size", str(self.chunk)]
        flags += ["--prefill", str(len(self.prefill)), "--decode", str(len(self.decode))]
        flags += ["--prefill-gpus", gpu_list(self.prefill), "--decode-gpus", gpu_list(self.decode)]
        if self.prefill_tp > 1 or self.decode_tp > 1:
            flags += ["--prefill-tp", str(self.prefill_tp), "--decode-tp", str(self.decode_tp)]
        if self.mps_split is not None:
            flags += ["--mps-split", f"{self.mps_split[0]}/{self.mps_split[1]}"]
        return flags


def gpu_list(workers: tuple[WorkerSlot, ...]) -> str:
    """The workers' GPUs in group order: pdserve-cluster cuts the list into groups of the role's TP size."""
    return ",".join(str(g) for w in workers for g in w.gpus)


def groups(first_gpu: int, num_workers: int, tp_size: int) -> list[WorkerSlot]:
    """num_workers workers of tp_size consecutive GPUs each, from first_gpu on."""
    return [
        WorkerSlot(tuple(range(first_gpu + i * tp_size, first_gpu + (i + 1) * tp_size))) for i in range(num_workers)
    ]


def tp_tag(tp_size: int) -> str:
    return "" if tp_size == 1 else f"(tp{tp_size})"


def colocated(num_gpus: int, chunk: int, tp_size: int = 1) -> Layout:
    """num_gpus / tp_size colocated workers of tp_size GPUs each."""
    if num_gpus % tp_size:
        raise ValueError(f"{num_gpus} GPUs do not split into TP groups of {tp_size}")
    name = f"colocated-c{chunk}" if tp_size == 1 else f"colocated-tp{tp_size}-c{chunk}"
    workers = tuple(groups(0, num_gpus // tp_size, tp_size))
    return Layout(name, "colocated", num_gpus, (), workers, chunk=chunk)


def disaggregated(
    num_prefill: int,
    num_decode: int,
    num_gpus: int,
    mps_split: tuple[int, int],
    prefill_tp: int = 1,
    decode_tp: int = 1,
) -> Layout:
    """p prefill then d decode workers over the GPUs in order, in TP groups; when their groups need one group
    more than the GPUs hold, the last prefill worker and the first decode worker share that group's GPUs under
    mps_split (their TP sizes equal); ValueError for any other GPU count."""
    overflow = num_prefill * prefill_tp + num_decode * decode_tp - num_gpus
    shared = overflow > 0
    if overflow not in (0, prefill_tp) or (shared and prefill_tp != decode_tp):
        raise ValueError(
            f"{num_prefill}P{tp_tag(prefill_tp)}:{num_decode}D{tp_tag(decode_tp)} does not fit {num_gpus} GPUs"
        )
    prefill = groups(0, num_prefill, prefill_tp)
    decode = groups(num_prefill * prefill_tp - overflow, num_decode, decode_tp)
    if shared:  # only the two workers on the shared GPUs split them (placement.Mps: a worker alone keeps its GPUs)
        prefill[-1] = WorkerSlot(prefill[-1].gpus, mps_split[0] / 100)
        decode[0] = WorkerSlot(decode[0].gpus, mps_split[1] / 100, 0.5)
    name = f"{num_prefill}P{tp_tag(prefill_tp)}:{num_decode}D{tp_tag(decode_tp)}" + ("-shared" if shared else "")
    return Layout(name, "disaggregated", num_gpus, tuple(prefill), tuple(decode), None, mps_split if shared else None)


def layouts_for(
    num_gpus: int,
    chunks: tuple[int, ...] = DEFAULT_CHUNKS,
    mps_split: tuple[int, int] = (50, 50),
    tp_sizes: tuple[int, ...] = (1,),
) -> list[Layout]:
    """Every layout the planner compares on num_gpus GPUs (module docstring): the one-GPU workers' first, then
    those with a TP size > 1 among tp_sizes, each using exactly the num_gpus GPUs."""
    if num_gpus < 1:
        raise ValueError("num_gpus must be >= 1")
    out = [colocated(num_gpus, c) for c in chunks]
    out += [disaggregated(p, num_gpus - p, num_gpus, mps_split) for p in range(1, num_gpus)]
    out += [disaggregated(p, num_gpus + 1 - p, num_gpus, mps_split) for p in range(1, num_gpus + 1)]
    sizes = sorted(set(tp_sizes) | {1})
    out += [colocated(num_gpus, c, t) for t in sizes[1:] if num_gpus % t == 0 for c in chunks]
    out += [disaggregated(p, d, num_gpus, mps_split, a, b) for a, b, p, d in tp_mixes(num_gpus, sizes)]
    if num_gpus in sizes[1:]:
        out.append(disaggregated(1, 1, num_gpus, mps_split, num_gpus, num_gpus))
    return out


def tp_mixes(num_gpus: int, sizes: list[int]) -> Iterator[tuple[int, int, int, int]]:
    """(prefill TP a, decode TP b, p, d) with a or b > 1 and p * a + d * b = num_gpus (p, d >= 1)."""
    for a, b in itertools.product(sizes, sizes):
        for p in range(1, num_gpus // a + 1):
            d, rest = divmod(num_gpus - p * a, b)
            if (a > 1 or b > 1) and d >= 1 and rest == 0:
                yield a, b, p, d
