#!/usr/bin/env python3
"""The MLP's gate/up projection + SwiGLU at several token counts (the issue-4 Llama shape: hidden 2048,
intermediate 8192, bf16): the fused Triton GEMM (kernels/swiglu_gemm.py) against cuBLAS + the SiLU-and-mul
kernel, over the stacked weight and over the interleaved one (the short-pass path), same process; microseconds
per call (median of CUDA-graph replays of 20 back-to-back calls), TFLOP/s, and how many outputs differ from the
cuBLAS path (the figures behind FUSED_MIN_TOKENS). Prints JSON.

    python scripts/bench_swiglu_gemm.py [--tokens 256,512,1024,2048,4000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from tune_decode_attention import median_us

from pdserve.kernels.fused_ops import silu_and_mul_blocks_triton, silu_and_mul_triton
from pdserve.kernels.swiglu_gemm import SWIGLU_BLOCK, interleave_gate_up, swiglu_gemm

HIDDEN, INTER = 2048, 8192


def bench(tokens: int, weight: torch.Tensor, weight_il: torch.Tensor) -> dict[str, Any]:
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=weight.dtype)
    gate_up = torch.empty(tokens, 2 * INTER, device="cuda", dtype=weight.dtype)
    out = {name: torch.empty(tokens, INTER, device="cuda", dtype=weight.dtype) for name in ("cublas", "il", "fused")}

    def stacked() -> None:
        torch.mm(x, weight.t(), out=gate_up)
        silu_and_mul_triton(gate_up[:, :INTER], gate_up[:, INTER:], out=out["cublas"])

    def interleaved() -> None:
        torch.mm(x, weight_il.t(), out=gate_up)
        silu_and_mul_blocks_triton(gate_up, SWIGLU_BLOCK, out=out["il"])

    def fused() -> None:
        swiglu_gemm(x, weight_il, out=out["fused"])

    row: dict[str, Any] = {"tokens": tokens}
    for name, fn in (("cublas_silu_us", stacked), ("cublas_blocks_silu_us", interleaved), ("fused_us", fused)):
        row[name] = round(median_us(fn, repeats=7, inner=20), 2)
    flop = 2 * tokens * HIDDEN * 2 * INTER
    row["fused_tflops"] = round(flop / row["fused_us"] / 1e6, 1)
    row["fused_vs_cublas"] = round(row["cublas_silu_us"] / row["fused_us"], 3)
    for name in ("il", "fused"):
        row[f"{name}_outputs_differing"] = int((out[name] != out["cublas"]).sum())
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", default="128,256,512,768,1024,1536,2048,3072,4000")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    weight = torch.randn(2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN**0.5
    weight_il = interleave_gate_up(weight).contiguous()
    rows = [bench(int(n), weight, weight_il) for n in args.tokens.split(",")]
    result = {
        "what": f"gate/up GEMM + SwiGLU, hidden {HIDDEN}, intermediate {INTER}, bf16",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
