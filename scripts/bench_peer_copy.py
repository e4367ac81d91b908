#!/usr/bin/env python3
"""KV handoff between two GPUs: the cuda_ipc pull across GPUs (CudaIpcSink._copy: the block-copy kernel on the
decode GPU reading the prefill pool over peer access) vs a plain torch peer copy of the same bytes, contiguous,
in the same process and run; the staged pull (gather on the prefill GPU, one copy, scatter on the decode GPU:
the path without peer access) beside them. GPU time of the copy (events around back-to-back calls) and host
wall time per handoff (synchronized); payload GB/s = payload bytes / time.

    python scripts/bench_peer_copy.py --out bench/results/peer_copy_h200x2.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pdserve.kernels.block_copy import copy_blocks
from pdserve.kvtransfer.cuda_ipc import CudaIpcSink, enable_peer_access
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.pool import KVPool


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--pool-blocks", type=int, default=1024, help="blocks of each pool (2 MB each by default)")
    p.add_argument("--payload-blocks", type=int, default=24, help="blocks per handoff (~50 MB by default)")
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--sweep", action="store_true", help="also time copy_blocks tiles and warps, pull and push")
    p.add_argument("--out", default=None)
    return p.parse_args()


def wall_us(fn: Callable[[int], None], repeats: int, device: torch.device) -> list[float]:
    """Host microseconds of fn(k) + synchronize, after 10 warm-up calls."""
    times = []
    for k in range(10 + repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn(k)
        torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e6)
    return times[10:]


def gpu_us(fn: Callable[[int], None], repeats: int, device: torch.device, calls: int = 20) -> list[float]:
    """GPU microseconds per call of fn(k) (enqueued on `device`'s current stream): events around `calls`
    back-to-back calls, so the host's launch time between them is hidden."""
    times = []
    with torch.cuda.device(device):
        for r in range(-1, max(1, repeats // calls)):  # round -1 warms up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for k in range(calls):
                fn(k)
            end.record()
            end.synchronize()
            if r >= 0:
                times.append(start.elapsed_time(end) * 1e3 / calls)
    return times


def summary(times: list[float], nbytes: int) -> dict[str, float]:
    med = statistics.median(times)
    return {"median_us": round(med, 1), "p90_us": round(sorted(times)[int(0.9 * len(times))], 1),
            "payload_GBps": round(nbytes / med / 1e3, 1)}  # fmt: skip


def sweep(src: torch.Tensor, dst: torch.Tensor, ids: list[int], nbytes: int) -> list[dict[str, Any]]:
    """copy_blocks alone, GPU time: pull runs on dst's GPU reading src over the link, push on src's GPU writing
    dst."""
    rows = []
    for direction, dev in (("pull", dst.device), ("push", src.device)):
        id_t = torch.tensor(ids, device=dev)
        for tile_bytes, num_warps in itertools.product((4096, 8192, 16384, 32768, 65536), (2, 4, 8, 16)):

            def copy(k: int) -> None:
                copy_blocks(src, dst, id_t, id_t, tile_bytes=tile_bytes, num_warps=num_warps)  # noqa: B023

            us = statistics.median(gpu_us(copy, 60, dev))
            rows.append({"direction": direction, "tile_bytes": tile_bytes, "num_warps": num_warps,
                         "kernel_us": round(us, 1), "payload_GBps": round(nbytes / us / 1e3, 1)})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


class Setup(NamedTuple):
    layout: KVLayout  # of both pools
    src: torch.Tensor  # the prefill pool, on GPU 0
    dst: torch.Tensor  # the decode pool, on GPU 1
    id_sets: list[list[int]]  # block ids of each handoff (the same ids in both pools)
    nbytes: int  # payload of one handoff


def timed_rows(setup: Setup, repeats: int) -> dict[str, dict[str, float]]:
    layout, src, dst, id_sets, nbytes = setup
    sink, staged = CudaIpcSink(KVPool(layout, dst), layout), CudaIpcSink(KVPool(layout, dst), layout)
    staged._reads[src.device] = False  # the path without peer access
    flat_src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=src.device)
    flat_dst = torch.empty_like(flat_src, device=dst.device)
    id_tensors = [torch.tensor(ids, device=dst.device) for ids in id_sets]

    def peer_copy(k: int) -> None:
        flat_dst.copy_(flat_src)

    def kernel(k: int) -> None:
        copy_blocks(src, dst, id_tensors[k % len(id_sets)], id_tensors[k % len(id_sets)])

    def pull(k: int) -> None:
        sink._copy(src, id_sets[k % len(id_sets)], id_sets[k % len(id_sets)]).wait()

    def staged_pull(k: int) -> None:
        staged._copy(src, id_sets[k % len(id_sets)], id_sets[k % len(id_sets)]).wait()

    for fn in (kernel, pull, staged_pull):
        dst.zero_()
        fn(1)
        torch.cuda.synchronize(dst.device)
        assert torch.equal(dst[:, :, id_sets[1]].cpu(), src[:, :, id_sets[1]].cpu()), f"{fn.__name__}: wrong blocks"
    return {
        "GPU time: torch peer copy (contiguous)": summary(gpu_us(peer_copy, repeats, dst.device), nbytes),
        "GPU time: copy_blocks on the decode GPU reading the prefill pool": summary(
            gpu_us(kernel, repeats, dst.device), nbytes
        ),
        "host wall: torch peer copy (contiguous)": summary(wall_us(peer_copy, repeats, dst.device), nbytes),
        "host wall: cuda_ipc pull (CudaIpcSink._copy + wait)": summary(wall_us(pull, repeats, dst.device), nbytes),
        "host wall: staged pull (gather, copy, scatter)": summary(wall_us(staged_pull, repeats, dst.device), nbytes),
    }


def main() -> int:
    args = parse_args()
    if torch.cuda.device_count() < 2:
        print("needs two GPUs", file=sys.stderr)
        return 2
    src_dev, dst_dev = torch.device("cuda:0"), torch.device("cuda:1")
    if not (enable_peer_access(dst_dev, src_dev) and enable_peer_access(src_dev, dst_dev)):
        print("no peer access between the GPUs", file=sys.stderr)
        return 2
    layout = KVLayout("bench", "bfloat16", args.block_size, args.layers, args.kv_heads, args.head_dim,
                      args.pool_blocks)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    setup = Setup(
        layout,
        torch.randn(layout.shape, dtype=torch.bfloat16, device=src_dev),
        torch.zeros(layout.shape, dtype=torch.bfloat16, device=dst_dev),
        [torch.randperm(args.pool_blocks - 1, generator=gen)[: args.payload_blocks].add(1).tolist() for _ in range(8)],
        layout.nbytes // layout.num_blocks * args.payload_blocks,
    )
    rows = timed_rows(setup, args.repeats)
    gbps = [r["payload_GBps"] for r in rows.values()]
    result = {
        "gpus": [torch.cuda.get_device_name(0), torch.cuda.get_device_name(1)],
        "peer_access": torch.cuda.can_device_access_peer(1, 0),
        "command": " ".join(["python", *sys.argv]),
        "payload_bytes": setup.nbytes,
        "rows": rows,
        "kernel_vs_torch_peer_copy_gpu_time": round(gbps[1] / gbps[0], 3),
        "pull_vs_torch_peer_copy_host_wall": round(gbps[3] / gbps[2], 3),
        "sweep": sweep(setup.src, setup.dst, setup.id_sets[0], setup.nbytes) if args.sweep else [],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "sweep"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
