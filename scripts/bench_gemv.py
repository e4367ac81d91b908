#!/usr/bin/env python3
"""One-row projections of the Llama-3-8B shape at TP 1 and TP 2 (each rank's share): cuBLAS (F.linear; the down
projection after the SiLU-and-mul kernel, as the model runs it now) against kernels/gemv.py at each tiling of a
sweep. Every timing is a CUDA graph of CALLS launches cycling over enough copies of the weight that none is in L2.
Writes one JSON (GPU, versions, command, per shape: cuBLAS, every tiling, the best, the error against fp32 math).

    python scripts/bench_gemv.py --out bench/results/gemv_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.kernels.fused_ops import silu_and_mul_blocks
from pdserve.kernels.gemv import GemvConfig, gemv, gemv_fits, gemv_ref, tiling
from pdserve.kernels.swiglu_gemm import SWIGLU_BLOCK

SHAPES: dict[str, tuple[int, int, int]] = {
    "tp1.qkv": (6144, 4096, 0), "tp1.o": (4096, 4096, 0), "tp1.gate_up": (28672, 4096, 0),
    "tp1.down": (4096, 14336, SWIGLU_BLOCK),
    "tp2.qkv": (3072, 4096, 0), "tp2.o": (4096, 2048, 0), "tp2.gate_up": (14336, 4096, 0),
    "tp2.down": (4096, 7168, SWIGLU_BLOCK),
    "smollm2.qkv": (960, 576, 0), "smollm2.o": (576, 576, 0), "smollm2.gate_up": (3072, 576, 0),
    "smollm2.down": (576, 1536, SWIGLU_BLOCK),
}  # fmt: skip
"""Name -> (N, K, SwiGLU half): W is [N, K]; the down projection's input is the [2K] interleaved gate/up row. The
8B shape's projections at TP 1 and 2, and the bundled SmolLM2-135M's."""
CALLS = 32
"""Launches per timed graph."""
L2_CLEAR_BYTES = 256 << 20
"""The weight copies of a shape add up to at least this (an H200's L2 is 50 MB)."""


def graph_us(run: Callable[[int], Any], replays: int = 20) -> float:
    """Microseconds per launch of run(i), i = 0 .. CALLS - 1, captured in one graph."""
    for i in range(CALLS):
        run(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            run(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * CALLS)


def sweep() -> list[GemvConfig]:
    grid = itertools.product((1, 2, 4, 8, 16), (64, 128, 256, 512, 1024, 2048, 4096), (2, 4, 8))
    return [GemvConfig(n, k, w) for n, k, w in grid if 8 <= n * k // (32 * w) <= 64]  # fp32 sums a thread


def one_shape(n: int, k: int, half: int, configs: list[GemvConfig]) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    copies = max(2, -(-L2_CLEAR_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5 for _ in range(copies)]
    x = torch.randn(1, 2 * k if half else k, device="cuda", dtype=torch.bfloat16, generator=gen)

    def cublas(i: int) -> Any:
        return F.linear(silu_and_mul_blocks(x, half) if half else x, weights[i % copies])

    ref = gemv_ref(x, weights[0], half).float()
    row: dict[str, Any] = {"n": n, "k": k, "swiglu": bool(half), "weight_MB": n * k * 2 / 1e6, "copies": copies}
    row["cublas_us"] = graph_us(cublas)
    row["cublas_max_err"] = (cublas(0).float() - ref).abs().max().item()
    tried = []
    for cfg in configs:
        if not gemv_fits(x, weights[0], half) or n % cfg.block_n or k % cfg.block_k:
            continue
        us = graph_us(lambda i, c=cfg: gemv(x, weights[i % copies], half, c))
        err = (gemv(x, weights[0], half, cfg).float() - ref).abs().max().item()
        tried.append({"config": cfg._asdict(), "us": us, "max_err": err})
    served = tiling(k)
    if served is not None:
        row["served"] = {"config": served._asdict(), "us": graph_us(lambda i: gemv(x, weights[i % copies], half))}
    best = min(tried, key=lambda t: t["us"])
    row |= {"best": best, "best_TBps": n * k * 2 / best["us"] / 1e6, "cublas_TBps": n * k * 2 / row["cublas_us"] / 1e6}
    row["ref_scale"] = ref.abs().max().item()
    return row | {"all": tried}


CHAINS: dict[str, tuple[str, str]] = {
    "tp1.attn": ("tp1.qkv", "tp1.o"), "tp1.mlp": ("tp1.gate_up", "tp1.down"),
    "tp2.attn": ("tp2.qkv", "tp2.o"), "tp2.mlp": ("tp2.gate_up", "tp2.down"),
}  # fmt: skip
"""Name -> two projections of a layer, each reading the other's output (q/k/v -> o reads q's columns)."""


def chain(first: str, second: str) -> dict[str, float]:
    """Microseconds per pair of CALLS / 2 dependent one-row projections, first and second in turn, each reading the
    one before's output, launched plainly and with programmatic dependent launch (a kernel may start while the one
    before it finishes)."""
    shapes = [SHAPES[first], SHAPES[second]]
    gen = torch.Generator(device="cuda").manual_seed(7)
    copies = max(2, -(-L2_CLEAR_BYTES // sum(n * k * 2 for n, k, _ in shapes)))
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5 for n, k, _ in shapes]
               for _ in range(copies)]  # fmt: skip
    start = torch.randn(1, shapes[0][1], device="cuda", dtype=torch.bfloat16, generator=gen)
    out: dict[str, float] = {}
    for pdl in (False, True):
        state = [start]

        def run(i: int, pdl: bool = pdl, state: list[torch.Tensor] = state) -> None:
            n, k, half = shapes[i % 2]
            x = (start if i == 0 else state[-1])[:, : 2 * k if half else k]
            state.append(gemv(x, weights[(i // 2) % copies][i % 2], half, pdl=pdl))

        out["pdl_us" if pdl else "plain_us"] = graph_us(run) * 2
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--chain", action="store_true", help="only dependent chains, plain vs programmatic launch")
    args = p.parse_args()
    configs = sweep()
    result: dict[str, Any] = {
        "what": "one-row projections, cuBLAS vs kernels/gemv.py, CUDA graphs of 32 launches over weights not in L2",
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "command": shlex.join([sys.executable, *sys.argv]),
        "shapes": {},
    }

    def save() -> None:  # NOTE: after every shape, so a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for name, pair in CHAINS.items() if args.chain else []:
        result["shapes"][name] = row = {"pair": pair, **chain(*pair)}
        print(f"{name:12s} a pair in a chain: plain {row['plain_us']:7.2f} us, PDL {row['pdl_us']:7.2f} us", flush=True)
        save()
    for name in [] if args.chain else args.shapes:
        row = one_shape(*SHAPES[name], configs)
        result["shapes"][name] = row
        best = row["best"]
        served = row.get("served", {}).get("us", float("nan"))
        print(f"{name:15s} cuBLAS {row['cublas_us']:7.2f} us ({row['cublas_TBps']:.2f} TB/s)  served {served:7.2f} us  "
              f"best {best['us']:7.2f} us "
              f"({row['best_TBps']:.2f} TB/s) {tuple(best['config'].values())} err {best['max_err']:.2e} "
              f"(cuBLAS {row['cublas_max_err']:.2e}, scale {row['ref_scale']:.2f})", flush=True)  # fmt: skip
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
