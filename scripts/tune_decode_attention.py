"""Sweep the Triton decode-attention tiles (tokens per tile, warps, split-K) on this GPU, and time torch SDPA
backends for the dense prefill shape beside the Triton prefill kernel.

    python scripts/tune_decode_attention.py [--out bench/out/tune_decode.json]

Decode shapes: the GPT-2-124M bench (128 sequences, 12 x 64 MHA) at the contexts it sees, Llama-1B / 8B GQA shapes
at long contexts, one Llama-8B sequence at TP 1 and at TP 2 (each rank's 16 heads, 4 KV heads), and Llama-8B batches
of 16 to 64 sequences of mixed lengths (1 to 4096 tokens, as a serving batch: with one split a sequence's program
reads its whole context, so the longest sets the time), the last three kinds with block tables as wide as the graphed
decode step's (8192 tokens: the default split count comes from that width).
Prints each config's median microseconds and the default's. --shapes picks some; --no-prefill skips the prefill.

    python scripts/tune_decode_attention.py --shapes llama8b-tp1-b1-ctx1024 llama8b-tp2-b1-ctx1024 --no-prefill
    python scripts/tune_decode_attention.py --shapes llama8b-b16-mixed2k llama8b-b17-mixed2k llama8b-b24-mixed2k \
        llama8b-b32-mixed2k llama8b-b64-mixed2k --no-prefill
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.kernels.decode_attention import (
    DecodeTileConfig,
    DecodeWorkspace,
    choose_decode_config,
    choose_num_splits,
    paged_decode_attention,
)
from pdserve.kernels.prefill_attention import paged_prefill_attention
from pdserve.kernels.triton_utils import device_num_sms

BLOCK_SIZE = 16
# name: (batch, heads, kv_heads, head_dim, context, block table width in tokens (0: the context's), mixed: the
# sequences' lengths drawn uniformly from 1 to 2 x context (seeded), as a serving batch's are, else all at context)
DECODE_SHAPES = {
    "gpt2-b128-ctx70": (128, 12, 12, 64, 70, 0, False),
    "gpt2-b128-ctx130": (128, 12, 12, 64, 130, 0, False),
    "llama1b-b64-ctx1000": (64, 32, 8, 64, 1000, 0, False),
    "llama8b-b32-ctx4000": (32, 32, 8, 128, 4000, 0, False),
    "llama8b-tp1-b1-ctx1024": (1, 32, 8, 128, 1024, 8192, False),
    "llama8b-tp2-b1-ctx1024": (1, 16, 4, 128, 1024, 8192, False),
    "llama8b-b16-mixed2k": (16, 32, 8, 128, 2048, 8192, True),
    "llama8b-b17-mixed2k": (17, 32, 8, 128, 2048, 8192, True),
    "llama8b-b24-mixed2k": (24, 32, 8, 128, 2048, 8192, True),
    "llama8b-b32-mixed2k": (32, 32, 8, 128, 2048, 8192, True),
    "llama8b-b64-mixed2k": (64, 32, 8, 128, 2048, 8192, True),
}
SPLITS = (1, 2, 4, 8, 16, 32, 64)


def median_us(fn: Callable[[], object], repeats: int, inner: int = 10) -> float:
    """GPU time of one call: `inner` calls captured in a CUDA graph, replayed `repeats` times (the host's
    launch cost, larger than these kernels, stays out of the figure)."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return sorted(times)[len(times) // 2]


def decode_inputs(
    batch: int, heads: int, kv_heads: int, head_dim: int, context: int, width: int, mixed: bool
) -> tuple[torch.Tensor, ...]:
    """q, the KV pool, block tables of max(width, longest) tokens a row (the tail blocks past a length unread),
    sequence lengths (mixed: uniform in 1 .. 2 x context)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    longest = 2 * context if mixed else context
    per_seq = -(-max(width, longest) // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    q = torch.randn((batch, heads, head_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn((2, num_blocks, BLOCK_SIZE, kv_heads, head_dim), generator=gen, device="cuda", dtype=q.dtype)
    tables = (torch.randperm(num_blocks - 1, generator=gen, device="cuda") + 1).to(torch.int32)
    tables = tables.view(batch, per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    if mixed:
        seq_lens = torch.randint(1, longest + 1, (batch,), generator=gen, device="cuda", dtype=torch.int32)
    return q, kv, tables, seq_lens


def sweep_shape(name: str, shape: tuple[int, ...], repeats: int) -> dict:
    batch, heads, kv_heads, head_dim, context, width, mixed = shape
    q, kv, tables, seq_lens = decode_inputs(batch, heads, kv_heads, head_dim, context, width, mixed)
    ws = DecodeWorkspace.allocate(batch, heads, head_dim, max(SPLITS), q.device)
    out = torch.empty_like(q)
    attend = functools.partial(paged_decode_attention, q, kv, tables, seq_lens, head_dim**-0.5, out, workspace=ws)
    rows = []
    for tile_n, warps, splits in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), SPLITS):
        cfg = DecodeTileConfig(tile_n, warps)
        try:
            us = median_us(functools.partial(attend, num_splits=splits, cfg=cfg), repeats)
        except Exception as exc:  # noqa: BLE001 - out of resources and the like: skip the config
            print(f"{name} {cfg} splits {splits}: {type(exc).__name__}")
            continue
        rows.append({"tile_n": tile_n, "num_warps": warps, "splits": splits, "us": us})
    default = choose_decode_config(head_dim, heads // kv_heads)
    default_splits = choose_num_splits(batch, kv_heads, tables.shape[1] * BLOCK_SIZE, device_num_sms(q.device))
    default_us = median_us(attend, repeats)
    rows.sort(key=lambda r: r["us"])
    kv_bytes = 2 * int(seq_lens.sum()) * kv_heads * head_dim * 2
    print(f"{name}: default {default} splits {default_splits}: {default_us:.1f} us; best {rows[:3]}")
    return {
        "default": {"config": default._asdict(), "splits": default_splits, "us": default_us},
        "kv_bytes": kv_bytes,
        "best_gb_per_s": kv_bytes / rows[0]["us"] / 1e3,
        "configs": rows,
    }


def sdpa_vs_triton_prefill(tokens: int, repeats: int) -> dict[str, float]:
    """Dense causal prefill of one sequence (Llama-1B heads): torch SDPA backends vs the Triton paged kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads, head_dim = 32, 8, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((1, heads, tokens, head_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn((1, kv_heads, tokens, head_dim), generator=gen, device="cuda", dtype=q.dtype)
    v = torch.randn_like(k)
    times: dict[str, float] = {}
    expanded = (k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))

    def sdpa(backend: SDPBackend, kk: torch.Tensor, vv: torch.Tensor, gqa: bool) -> None:
        with sdpa_kernel(backend):
            torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)

    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else expanded
            key = f"sdpa-{backend.name.lower()}{'-gqa' if gqa else '-expanded'}"
            try:
                times[key] = median_us(functools.partial(sdpa, backend, kk, vv, gqa), repeats)
            except Exception as exc:  # noqa: BLE001 - a backend that does not take the shape
                print(f"{key}: {type(exc).__name__}: {str(exc)[:120]}")
    num_blocks = tokens // BLOCK_SIZE + 8
    kv = torch.randn((2, num_blocks, BLOCK_SIZE, kv_heads, head_dim), generator=gen, device="cuda", dtype=q.dtype)
    tables = (torch.arange(-(-tokens // BLOCK_SIZE), device="cuda") + 1).to(torch.int32)[None, :]
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    flat_q = q[0].transpose(0, 1).contiguous()  # [tokens, heads, head_dim]
    flat_k, flat_v = (t[0].transpose(0, 1).contiguous() for t in (k, v))  # [tokens, kv_heads, head_dim]
    out = torch.empty_like(flat_q)
    times["triton-prefill"] = median_us(
        lambda: paged_prefill_attention(flat_q, flat_k, flat_v, kv, tables, qsl, seq_lens, tokens, head_dim**-0.5, out),
        repeats,
    )
    flops = 2 * 2 * heads * head_dim * tokens**2 / 2
    for key, us in times.items():
        print(f"prefill {tokens} tokens {key:32s} {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s")
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", nargs="+", choices=list(DECODE_SHAPES), default=list(DECODE_SHAPES))
    p.add_argument("--no-prefill", action="store_true")
    args = p.parse_args()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "decode": {name: sweep_shape(name, DECODE_SHAPES[name], args.repeats) for name in args.shapes},
        "prefill_us": {} if args.no_prefill else sdpa_vs_triton_prefill(args.tokens, args.repeats),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
