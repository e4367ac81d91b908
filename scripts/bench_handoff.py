#!/usr/bin/env python3
"""KV handoff copy on one GPU: torch fancy indexing vs the Triton copy_blocks kernel, and the cuda_ipc pull.

Default shape: Llama-8B-like pools (32 layers, block_size 16, 8 KV heads, head_dim 128, bf16: a 32 KB chunk per
block, layer and K/V, 2 MB per block over all layers), a 4 GB source pool and a 3 GB destination pool (so their
num_blocks differ), handoffs of ~50 MB (24 blocks) at random scattered ids, rotating among 8 id sets so that no
handoff finds its blocks in L2.

Kernel rows are GPU times: CUDA events around each call, with a sleep kernel queued first so that the host's
launch overhead is not counted. The pull row is host wall time of CudaIpcSink._copy (id upload, launch,
synchronize), what a decode worker waits per handoff. Payload GB/s = payload bytes / time; read+write GB/s
counts both.

    python scripts/bench_handoff.py --out bench/results/handoff.json
    python scripts/bench_handoff.py --sweep  # also tile sizes and warps of copy_blocks
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch
import triton

from pdserve.kernels.block_copy import DEFAULT_NUM_WARPS, DEFAULT_TILE_BYTES, copy_blocks
from pdserve.kvtransfer.cuda_ipc import CudaIpcSink
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.pool import KVPool

CALLS_PER_SLEEP = 25
SLEEP_CYCLES = 20_000_000
"""~10 ms at 2 GHz: longer than the host needs to queue CALLS_PER_SLEEP calls."""
SWEEP = [(8192, 4), (16384, 4), (16384, 8), (32768, 4), (32768, 8), (65536, 8)]
"""(tile_bytes, num_warps) of copy_blocks tried by --sweep."""

IdSet = tuple[torch.Tensor, torch.Tensor]  # ([n] source ids, [n] destination ids), int64 on the GPU
CopyFn = Callable[[torch.Tensor, torch.Tensor], None]


class Setup(NamedTuple):
    src: torch.Tensor  # [num_layers, 2, src_num_blocks, block_size, kv_heads, head_dim]
    dst: torch.Tensor  # [num_layers, 2, dst_num_blocks, block_size, kv_heads, head_dim]
    dst_layout: KVLayout
    id_sets: list[IdSet]
    sizes: dict[str, int | str]

    @property
    def payload_bytes(self) -> int:
        return int(self.sizes["payload_bytes"])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--src-pool-gb", type=float, default=4.0)
    p.add_argument("--dst-pool-gb", type=float, default=3.0)
    p.add_argument("--payload-mb", type=float, default=50.0, help="bytes per handoff, all layers, K and V")
    p.add_argument("--id-sets", type=int, default=8)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--sweep", action="store_true", help="also time copy_blocks over tile sizes and warps")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def make_setup(args: argparse.Namespace) -> Setup:
    layout = KVLayout("bench", args.dtype, args.block_size, args.layers, args.kv_heads, args.head_dim, num_blocks=1)
    chunk_bytes = args.block_size * args.kv_heads * args.head_dim * layout.torch_dtype.itemsize
    block_bytes = layout.nbytes  # one block of every layer, K and V
    n = max(1, round(args.payload_mb * 1e6 / block_bytes))
    num_src, num_dst = int(args.src_pool_gb * 1e9 // block_bytes), int(args.dst_pool_gb * 1e9 // block_bytes)
    assert min(num_src, num_dst) >= n, "pools smaller than one handoff"
    src_layout, dst_layout = replace(layout, num_blocks=num_src), replace(layout, num_blocks=num_dst)
    src = torch.empty(src_layout.shape, dtype=layout.torch_dtype, device="cuda").normal_()
    dst = torch.zeros(dst_layout.shape, dtype=layout.torch_dtype, device="cuda")
    gen = torch.Generator().manual_seed(0)
    id_sets = [
        (torch.randperm(num_src, generator=gen)[:n].cuda(), torch.randperm(num_dst, generator=gen)[:n].cuda())
        for _ in range(args.id_sets)
    ]
    sizes: dict[str, int | str] = {
        "num_layers": args.layers,
        "block_size": args.block_size,
        "num_kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "chunk_bytes": chunk_bytes,
        "blocks_per_handoff": n,
        "payload_bytes": n * block_bytes,
        "src_num_blocks": num_src,
        "dst_num_blocks": num_dst,
        "src_pool_bytes": src.numel() * src.element_size(),
        "dst_pool_bytes": dst.numel() * dst.element_size(),
        "id_sets": args.id_sets,
    }
    return Setup(src, dst, dst_layout, id_sets, sizes)


def time_gpu(fn: CopyFn, id_sets: list[IdSet], warmup: int, repeats: int) -> list[float]:
    """GPU microseconds of each call: events between consecutive calls, queued behind a sleep kernel."""
    for k in range(warmup):
        fn(*id_sets[k % len(id_sets)])
    torch.cuda.synchronize()
    times: list[float] = []
    while len(times) < repeats:
        calls = min(CALLS_PER_SLEEP, repeats - len(times))
        events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
        torch.cuda._sleep(SLEEP_CYCLES)
        events[0].record()
        for k in range(calls):
            fn(*id_sets[(len(times) + k) % len(id_sets)])
            events[k + 1].record()
        torch.cuda.synchronize()
        times += [events[k].elapsed_time(events[k + 1]) * 1e3 for k in range(calls)]
    return times


def time_pull(setup: Setup, warmup: int, repeats: int) -> list[float]:
    """Host wall microseconds of CudaIpcSink._copy with both pools on this GPU (synchronous)."""
    sink = CudaIpcSink(KVPool(setup.dst_layout, setup.dst), setup.dst_layout)
    id_lists = [(src_ids.tolist(), dst_ids.tolist()) for src_ids, dst_ids in setup.id_sets]
    times = []
    for k in range(warmup + repeats):
        src_ids, dst_ids = id_lists[k % len(id_lists)]
        start = time.perf_counter()
        sink._copy(setup.src, src_ids, dst_ids)
        times.append((time.perf_counter() - start) * 1e6)
    return times[warmup:]


def copy_fns(setup: Setup, sweep: bool) -> dict[str, CopyFn]:
    src, dst = setup.src, setup.dst

    def fancy(src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        dst[:, :, dst_ids] = src[:, :, src_ids]

    def select_copy(src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        dst.index_copy_(2, dst_ids, src.index_select(2, src_ids))

    def kernel(tile_bytes: int, num_warps: int) -> CopyFn:
        return lambda s, d: copy_blocks(src, dst, s, d, tile_bytes=tile_bytes, num_warps=num_warps)

    fns: dict[str, CopyFn] = {"torch fancy indexing": fancy, "torch index_select+index_copy_": select_copy}
    fns["copy_blocks"] = kernel(DEFAULT_TILE_BYTES, DEFAULT_NUM_WARPS)
    for tile_bytes, num_warps in SWEEP if sweep else []:
        fns[f"copy_blocks tile {tile_bytes // 1024}K warps {num_warps}"] = kernel(tile_bytes, num_warps)
    return fns


def check_kernel(setup: Setup) -> bool:
    """copy_blocks leaves the destination blocks equal to the source blocks (first id set)."""
    src_ids, dst_ids = setup.id_sets[0]
    setup.dst.zero_()
    copy_blocks(setup.src, setup.dst, src_ids, dst_ids)
    copied = setup.dst[:, :, dst_ids]
    others_untouched = int(setup.dst.count_nonzero()) == int(copied.count_nonzero())
    return torch.equal(copied, setup.src[:, :, src_ids]) and others_untouched


def summarize(times: list[float], payload_bytes: int) -> dict[str, float]:
    median = statistics.median(times)
    return {
        "median_us": median,
        "p90_us": sorted(times)[int(0.9 * (len(times) - 1))],
        "payload_GBps": payload_bytes / median / 1e3,
        "read_write_GBps": 2 * payload_bytes / median / 1e3,
    }


def print_table(rows: dict[str, dict[str, float]], setup: Setup) -> None:
    sizes = setup.sizes
    print(f"{torch.cuda.get_device_name()}: {sizes['blocks_per_handoff']} blocks x {sizes['num_layers']} layers x K/V "
          f"x {sizes['chunk_bytes']} B = {setup.payload_bytes / 1e6:.1f} MB per handoff")  # fmt: skip
    print(f"{'method':42s} {'median us':>10s} {'p90 us':>9s} {'payload GB/s':>13s} {'r+w GB/s':>9s} {'speedup':>8s}")
    for name, r in rows.items():
        print(
            f"{name:42s} {r['median_us']:10.1f} {r['p90_us']:9.1f} {r['payload_GBps']:13.0f} "
            f"{r['read_write_GBps']:9.0f} {r['speedup_vs_torch_fancy']:7.2f}x"
        )


def main() -> int:
    args = parse_args()
    setup = make_setup(args)
    verified = check_kernel(setup)
    rows = {
        name: summarize(time_gpu(fn, setup.id_sets, args.warmup, args.repeats), setup.payload_bytes)
        for name, fn in copy_fns(setup, args.sweep).items()
    }
    rows["cuda_ipc pull (host wall, sync)"] = summarize(
        time_pull(setup, args.warmup, args.repeats), setup.payload_bytes
    )
    base_us = rows["torch fancy indexing"]["median_us"]
    for row in rows.values():
        row["speedup_vs_torch_fancy"] = base_us / row["median_us"]
    print_table(rows, setup)
    result = {
        "what": "KV handoff block copy on one GPU; kernel rows GPU time, the pull row host wall time",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "command": " ".join(sys.argv),
        "sizes": setup.sizes,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "kernel_matches_torch": verified,
        "results": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
