"""Sweep the Triton prefill-attention tiles on this GPU: one causal sequence of --tokens new tokens, paged KV,
bf16, for the head shapes of the 1B (32 x 64, 8 KV heads) and 8B (32 x 128, 8 KV heads) Llama benches.

    python scripts/tune_prefill_attention.py [--tokens 4000] [--out bench/out/tune_prefill.json]

Prints each config's median time and TFLOP/s (causal: 2 * 2 * heads * d * tokens^2 / 2) and the default's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.prefill_attention import (  # noqa: E402
    PrefillTileConfig,
    choose_tile_config,
    launch_prefill_kernel,
)

SHAPES = {"llama-1b": (32, 8, 64), "llama-8b": (32, 8, 128)}
BLOCK_SIZE = 16


def inputs(tokens: int, heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = tokens // BLOCK_SIZE + 8
    q = torch.randn((tokens, heads, head_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
    kv_shape = (2, num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    kv = torch.randn(kv_shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(num_blocks - 1, generator=gen, device="cuda")[: -(-tokens // BLOCK_SIZE)] + 1
    block_tables = table.to(torch.int32)[None, :]
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    return q, kv, block_tables, qsl, seq_lens


def time_config(args: tuple[torch.Tensor, ...], cfg: PrefillTileConfig, repeats: int) -> float:
    q, kv, bt, qsl, sl = args
    out = torch.empty_like(q)

    def run() -> None:
        launch_prefill_kernel(q, kv, bt, qsl, sl, q.shape[0], q.shape[2] ** -0.5, out, cfg)

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result: dict = {"gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "shapes": {}}
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        data = inputs(args.tokens, heads, kv_heads, head_dim)
        flops = 2 * 2 * heads * head_dim * args.tokens**2 / 2
        default = choose_tile_config(head_dim, torch.bfloat16, args.tokens)
        rows = []
        for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
            cfg = PrefillTileConfig(bm, bn, warps, stages)
            try:
                ms = time_config(data, cfg, args.repeats)
            except Exception as exc:  # noqa: BLE001 - out of shared memory and the like: skip the config
                print(f"{name} {cfg}: {type(exc).__name__}")
                continue
            rows.append({"config": cfg._asdict(), "ms": ms, "tflops": flops / ms / 1e9, "default": cfg == default})
        rows.sort(key=lambda r: r["ms"])
        result["shapes"][name] = rows
        print(f"== {name}: heads {heads}, kv heads {kv_heads}, head_dim {head_dim}, {args.tokens} tokens")
        for r in rows[:6] + [r for r in rows if r["default"]]:
            mark = "  (default)" if r["default"] else ""
            print(f"  {r['config']}  {r['ms']:.3f} ms  {r['tflops']:.0f} TFLOP/s{mark}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
