#!/usr/bin/env python3
"""KV handoff between two GPUs: the cuda_ipc pull across GPUs (gather on the prefill GPU, one peer copy,
scatter on the decode GPU: CudaIpcSink._copy) vs a plain torch peer copy of the same bytes, contiguous, in the
same process and run. Host wall time per handoff, synchronized; payload GB/s = payload bytes / time.

    python scripts/bench_peer_copy.py --out bench/results/peer_copy_h200x2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtransfer.cuda_ipc import CudaIpcSink  # noqa: E402
from kvtransfer.layout import KVLayout  # noqa: E402
from kvtransfer.pool import KVPool  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--pool-blocks", type=int, default=1024, help="blocks of each pool (2 MB each by default)")
    p.add_argument("--payload-blocks", type=int, default=24, help="blocks per handoff (~50 MB by default)")
    p.add_argument("--repeats", type=int, default=100)
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


def summary(times: list[float], nbytes: int) -> dict[str, float]:
    med = statistics.median(times)
    return {"median_us": round(med, 1), "p90_us": round(sorted(times)[int(0.9 * len(times))], 1),
            "payload_GBps": round(nbytes / med / 1e3, 1)}  # fmt: skip


def main() -> int:
    args = parse_args()
    if torch.cuda.device_count() < 2:
        print("needs two GPUs", file=sys.stderr)
        return 2
    src_dev, dst_dev = torch.device("cuda:0"), torch.device("cuda:1")
    layout = KVLayout("bench", "bfloat16", args.block_size, args.layers, args.kv_heads, args.head_dim,
                      args.pool_blocks)  # fmt: skip
    src = torch.randn(layout.shape, dtype=torch.bfloat16, device=src_dev)
    dst = torch.zeros(layout.shape, dtype=torch.bfloat16, device=dst_dev)
    sink = CudaIpcSink(KVPool(layout, dst), layout)
    gen = torch.Generator().manual_seed(0)
    id_sets = [torch.randperm(args.pool_blocks - 1, generator=gen)[: args.payload_blocks].add(1).tolist()
               for _ in range(8)]  # fmt: skip
    nbytes = layout.nbytes // layout.num_blocks * args.payload_blocks
    flat_src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=src_dev)
    flat_dst = torch.empty_like(flat_src, device=dst_dev)

    def peer_copy(k: int) -> None:
        flat_dst.copy_(flat_src)

    def pull(k: int) -> None:
        ids = id_sets[k % len(id_sets)]
        sink._copy(src, ids, ids).wait()

    rows = {
        "torch peer copy (contiguous)": summary(wall_us(peer_copy, args.repeats, dst_dev), nbytes),  # fmt: skip
        "cuda_ipc pull across GPUs (gather, peer copy, scatter)": summary(wall_us(pull, args.repeats, dst_dev), nbytes),
    }
    ids = id_sets[0]
    pull(0)
    assert torch.equal(dst[:, :, ids].cpu(), src[:, :, ids].cpu()), "the pulled blocks differ"
    base, ours = (r["payload_GBps"] for r in rows.values())
    result = {
        "gpus": [torch.cuda.get_device_name(0), torch.cuda.get_device_name(1)],
        "peer_access": torch.cuda.can_device_access_peer(1, 0),
        "command": " ".join(["python", *sys.argv]),
        "payload_bytes": nbytes,
        "rows": rows,
        "pull_vs_torch_peer_copy": round(ours / base, 3),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
