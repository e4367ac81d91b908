"""Sweep the Triton prefill-attention tiles on this GPU: one causal sequence of --tokens new tokens, bf16, for
the head shapes of the 1B (32 x 64, 8 KV heads) and 8B (32 x 128, 8 KV heads) Llama benches, with the new
tokens' K/V read through TMA descriptors and through plain pointer loads.

    python scripts/tune_prefill_attention.py [--tokens 4000] [--out bench/out/tune_prefill.json]

Prints each config's median time and TFLOP/s (causal: 2 * 2 * heads * d * tokens^2 / 2) and the default's;
--prefix N also times the default over a cached prefix of N tokens (paged reads) before the new tokens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from pdserve.kernels.prefill_attention import (
    PrefillTileConfig,
    choose_tile_config,
    launch_prefill_kernel,
    tma_supported,
)

SHAPES = {"llama-1b": (32, 8, 64), "llama-8b": (32, 8, 128)}
BLOCK_SIZE = 16


def inputs(tokens: int, heads: int, kv_heads: int, head_dim: int, prefix: int = 0) -> tuple[torch.Tensor, ...]:
    """q, K/V of the new tokens as the model hands them over (q and K fresh out of rope, V a strided view of the
    fused qkv projection), a paged cache over shuffled blocks holding prefix + new tokens, block table,
    query_start_loc, seq_lens."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = prefix + tokens
    num_blocks = total // BLOCK_SIZE + 8
    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(tokens, heads, head_dim).clone(), k.reshape(tokens, kv_heads, head_dim).clone()
    v = v.view(tokens, kv_heads, head_dim)
    kv_shape = (2, num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    kv = torch.randn(kv_shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(num_blocks - 1, generator=gen, device="cuda")[: -(-total // BLOCK_SIZE)] + 1
    block_tables = table.to(torch.int32)[None, :]
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([total], dtype=torch.int32, device="cuda")
    return q, k, v, kv, block_tables, qsl, seq_lens


def time_config(args: tuple[torch.Tensor, ...], cfg: PrefillTileConfig, tma: bool, repeats: int) -> float:
    q, k, v, kv, bt, qsl, sl = args
    out = torch.empty_like(q)

    def run() -> None:
        launch_prefill_kernel(q, k, v, kv, bt, qsl, sl, q.shape[0], q.shape[2] ** -0.5, out, cfg, tma)

    return median_ms(run, repeats)


def _prefix_row(args: argparse.Namespace, heads: int, kv_heads: int, head_dim: int) -> dict[str, float]:
    """The default config with a cached prefix of --prefix tokens before the --tokens new ones."""
    data = inputs(args.tokens, heads, kv_heads, head_dim, prefix=args.prefix)
    tma = tma_supported(*data[:3])
    cfg = choose_tile_config(head_dim, torch.bfloat16, args.tokens)
    ms = time_config(data, cfg, tma, args.repeats)
    n, c = args.tokens, args.prefix
    flops = 2 * 2 * heads * head_dim * (n * c + n * n / 2)
    print(f"  default after a {c}-token cached prefix: {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s")
    return {"ms": ms, "tflops": flops / ms / 1e9}


def sdpa_first_calls(lengths: list[int], repeats: int) -> list[dict[str, float]]:
    """torch SDPA on cuDNN, dense causal GQA (Llama-1B heads), per prompt length: the first call's time (a new
    length builds a new cuDNN graph) and the steady median, beside the Triton paged kernel at that length."""
    return [_sdpa_row(n, repeats) for n in lengths]


def _sdpa_row(n: int, repeats: int) -> dict[str, float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads, head_dim = SHAPES["llama-1b"]
    q, k, v, kv, bt, qsl, sl = inputs(n, heads, kv_heads, head_dim)
    qd = q.transpose(0, 1)[None]  # [1, heads, n, d] view of [n, heads, d]
    kd = torch.randn((1, kv_heads, n, head_dim), device="cuda", dtype=q.dtype)
    vd = torch.randn_like(kd)

    def sdpa() -> None:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

    torch.cuda.synchronize()
    start = time.perf_counter()
    sdpa()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - start) * 1e3
    steady = median_ms(sdpa, repeats)
    tma = tma_supported(q, k, v)
    cfg = choose_tile_config(head_dim, q.dtype, n)
    out = torch.empty_like(q)
    triton_ms = median_ms(
        lambda: launch_prefill_kernel(q, k, v, kv, bt, qsl, sl, n, head_dim**-0.5, out, cfg, tma), repeats
    )
    print(f"sdpa cudnn {n:6d} tokens: first {first_ms:7.2f} ms, steady {steady:.3f} ms, triton {triton_ms:.3f} ms")
    return {"tokens": n, "cudnn_first_ms": first_ms, "cudnn_ms": steady, "triton_ms": triton_ms}


def median_ms(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median over runs that each start from a cold L2, as inside a model (the GEMMs before it evict it)."""
    fn()
    times = []
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--sdpa", default="", help="comma-separated prompt lengths: also time cuDNN SDPA at each")
    p.add_argument("--prefix", type=int, default=0, help="also time the default config after a cached prefix")
    args = p.parse_args()
    result: dict = {"gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "shapes": {}}
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        data = inputs(args.tokens, heads, kv_heads, head_dim)
        flops = 2 * 2 * heads * head_dim * args.tokens**2 / 2
        default_tma = tma_supported(*data[:3])
        default = choose_tile_config(head_dim, torch.bfloat16, args.tokens)
        rows = []
        for tma, bm, bn, warps, stages in itertools.product((True, False), (64, 128), (64, 128), (4, 8), (2, 3, 4)):
            cfg = PrefillTileConfig(bm, bn, warps, stages)
            try:
                ms = time_config(data, cfg, tma, args.repeats)
            except Exception as exc:  # noqa: BLE001 - out of shared memory and the like: skip the config
                print(f"{name} {cfg} tma={tma}: {type(exc).__name__}")
                continue
            is_default = cfg == default and tma == default_tma
            row = {"config": cfg._asdict(), "tma": tma, "ms": ms, "tflops": flops / ms / 1e9, "default": is_default}
            rows.append(row)
        rows.sort(key=lambda r: r["ms"])
        result["shapes"][name] = rows
        print(f"== {name}: heads {heads}, kv heads {kv_heads}, head_dim {head_dim}, {args.tokens} tokens")
        for r in rows[:6] + [r for r in rows if r["default"]]:
            mark = "  (default)" if r["default"] else ""
            print(f"  {r['config']} tma={r['tma']}  {r['ms']:.3f} ms  {r['tflops']:.0f} TFLOP/s{mark}")
        if args.prefix:
            result["shapes"][name + f"-after-{args.prefix}-cached"] = _prefix_row(args, heads, kv_heads, head_dim)
    if args.sdpa:
        result["sdpa_cudnn"] = sdpa_first_calls([int(n) for n in args.sdpa.split(",")], args.repeats)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
