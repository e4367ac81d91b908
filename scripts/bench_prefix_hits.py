#!/usr/bin/env python3
"""Prefill latency of prefix hits: a cached prefix plus a few new tokens, through the engine, on CUDA.

Each pair CACHED:NEW times prompts of a CACHED-token prefix (cached once before the clock, a multiple of the
block size; 0: fresh prompts) and NEW fresh tokens (a prefix hit, a chat turn), max_tokens 1, with the prefill
kernel's split-KV as shipped (passes split from SPLIT_MIN_PREFIX cached tokens) and off (every pass unsplit),
each in its own engine of one process, and the same prompt length with no cache (a miss). Default shape: the
Llama-1B shape of bench_prefill.py, bf16, dummy weights.

    python scripts/bench_prefix_hits.py --pairs 896:104,4000:100,7936:128 --out bench/results/prefix_hits.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from bench_prefill import SHAPE, print_profile, time_cuda, write_config

import pdserve.kernels.split_policy as split_policy
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.core.messages import pack_token_ids, unpack_token_ids
from pdserve.core.sampling_params import SamplingParams

BLOCK_SIZE = 16


def bench_hits(folder: Path, cached: int, new: int, repeats: int, split: bool, profile: bool) -> list[float]:
    """ms per engine.generate of prefix + `new` fresh tokens, the prefix cached; split=False: unsplit passes."""
    assert cached % BLOCK_SIZE == 0, f"the cached prefix must be whole blocks of {BLOCK_SIZE}"
    saved = split_policy.SPLIT_MIN_PREFIX
    if not split:  # NOTE: choose_num_splits reads the threshold when called: no pass splits
        split_policy.SPLIT_MIN_PREFIX = 1 << 30
    try:
        engine = _engine(folder, cached + new, (cached + (repeats + 8) * new) // BLOCK_SIZE + 64)
        gen = torch.Generator().manual_seed(cached * 7 + new)
        vocab = SHAPE["vocab_size"]
        prefix = torch.randint(0, vocab, (cached,), generator=gen).tolist()
        one = SamplingParams(temperature=0.0, max_tokens=1)
        if prefix:
            engine.generate([prefix], one)  # caches the prefix
        # NOTE: every prompt is made (and unpacked, as a worker gets it) before the clock; each is a fresh suffix
        made = [prefix + torch.randint(0, vocab, (new,), generator=gen).tolist() for _ in range(repeats + 4)]
        prompts = iter([unpack_token_ids(pack_token_ids(ids)) for ids in made])

        def run() -> None:
            engine.generate([next(prompts)], one)

        time_cuda(run, 3)
        times = time_cuda(run, repeats)
        if profile:
            print_profile(f"hit {cached}+{new}, split {split}", run)
        return times
    finally:
        split_policy.SPLIT_MIN_PREFIX = saved


def bench_miss(folder: Path, tokens: int, repeats: int) -> list[float]:
    """ms per engine.generate of a fresh `tokens`-token prompt, prefix caching off."""
    engine = _engine(folder, tokens, tokens // BLOCK_SIZE + 64, prefix_caching=False)
    gen = torch.Generator().manual_seed(tokens)
    made = [torch.randint(0, SHAPE["vocab_size"], (tokens,), generator=gen).tolist() for _ in range(repeats + 3)]
    prompts = itertools.cycle([unpack_token_ids(pack_token_ids(ids)) for ids in made])
    one = SamplingParams(temperature=0.0, max_tokens=1)
    time_cuda(lambda: engine.generate([next(prompts)], one), 3)
    return time_cuda(lambda: engine.generate([next(prompts)], one), repeats)


def _engine(folder: Path, max_tokens: int, num_blocks: int, prefix_caching: bool = True) -> Engine:
    """A prefill worker's engine (scheduler defaults: passes of up to 4096 tokens; no decode graphs)."""
    model = ModelConfig.from_pretrained(folder, dtype="bfloat16", load_format="dummy")
    assert max_tokens < model.max_model_len, f"{max_tokens} tokens exceed the shape's {model.max_model_len}"
    return Engine(
        EngineConfig(
            model,
            CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
            SchedulerConfig(max_num_seqs=4),
            device="cuda",
            attention_backend="triton",
            capture_decode=False,
        )
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pairs", default="0:104,896:104,2048:104,4000:100,7936:128", help="CACHED:NEW,...")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="print the GPU kernels of one call of each hit run")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    folder = write_config(Path(tempfile.mkdtemp()))
    rows: dict[str, dict[str, float]] = {}
    for pair in args.pairs.split(","):
        cached, new = (int(x) for x in pair.split(":"))
        row = {
            "hit_split_ms": statistics.median(bench_hits(folder, cached, new, args.repeats, True, args.profile)),
            "hit_unsplit_ms": statistics.median(bench_hits(folder, cached, new, args.repeats, False, args.profile)),
            "miss_ms": statistics.median(bench_miss(folder, cached + new, args.repeats)),
        }
        row["split_vs_unsplit"] = row["hit_split_ms"] / row["hit_unsplit_ms"]
        row["hit_vs_miss"] = row["hit_split_ms"] / row["miss_ms"]
        rows[pair] = row
        print(f"{pair:>12s}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    result: dict[str, Any] = {
        "what": f"prefix-hit prefill latency (median of {args.repeats}), bf16, Llama shape {SHAPE}",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
