#!/usr/bin/env python3
"""Decode throughput of the engine vs transformers `generate` on a static batch, same GPU, same process.

Default workload (issue 4): GPT-2-124M shape with seeded dummy weights, bf16, 128 requests x 128 new
tokens, prompts alternately 1 and 4 tokens, ignore_eos. Throughput = generated tokens / wall time of the
whole batch (prefill included, for both). Prints a table and writes JSON.

    python scripts/bench_decode.py --out bench/results/decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.core.sampling_params import SamplingParams

GPT2_124M: dict[str, Any] = dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024)


def write_config(folder: Path) -> Path:
    from transformers import GPT2Config

    GPT2Config(**GPT2_124M).save_pretrained(folder)
    return folder


def prompts_of(num: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 50257, (1 if i % 2 == 0 else 4,), generator=gen).tolist() for i in range(num)]


def timed(fn: Callable[[], int], repeats: int) -> list[float]:
    """Tokens per second of each run of fn (which returns the number of generated tokens)."""
    rates = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = fn()
        torch.cuda.synchronize()
        rates.append(tokens / (time.perf_counter() - start))
    return rates


def bench_transformers(folder: Path, prompts: list[list[int]], new_tokens: int, repeats: int) -> list[float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16).cuda().eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")  # left padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")

    def run() -> int:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return (out.shape[1] - width) * len(prompts)

    timed(run, 1)
    return timed(run, repeats)


def bench_engine(folder: Path, prompts: list[list[int]], new_tokens: int, repeats: int, eager: bool) -> list[float]:
    model = ModelConfig.from_pretrained(folder, dtype="bfloat16", load_format="dummy")
    cfg = EngineConfig(
        model,
        CacheConfig(num_blocks=len(prompts) * (-(-(new_tokens + 4) // 16) + 1) + 16, enable_prefix_caching=False),
        SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=4096),
        device="cuda",
        attention_backend="triton",
        enforce_eager=eager,
    )
    engine = Engine(cfg)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    def run() -> int:
        return sum(len(t) for t in engine.generate(prompts, params))

    timed(run, 1)
    rates = timed(run, repeats)
    if engine.runner.graphs is not None:
        GRAPH_STEP_MS[len(prompts)] = replay_ms(engine, len(prompts))
        if PROFILE:
            profile_replay(engine, len(prompts))
    return rates


PROFILE = False


def profile_replay(engine: Engine, batch: int, repeats: int = 20) -> None:
    """The GPU kernels of a captured decode step by total time (where a step's GPU time goes)."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.runner.graphs
    assert graphs is not None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            graphs.replay(batch)
        torch.cuda.synchronize()
    print(f"==== decode graph replay, batch {batch}, {repeats} replays")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))


GRAPH_STEP_MS: dict[int, float] = {}
"""GPU time of one captured decode step by batch size (the floor under the engine's host work)."""


def replay_ms(engine: Engine, batch: int, repeats: int = 200) -> float:
    graphs = engine.runner.graphs
    assert graphs is not None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs.replay(batch)
    start.record()
    for _ in range(repeats):
        graphs.replay(batch)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true", help="print the kernels of a captured decode step")
    args = p.parse_args()
    global PROFILE
    PROFILE = args.profile
    folder = write_config(Path(tempfile.mkdtemp()))
    prompts = prompts_of(args.requests)
    rows = {"transformers-generate": bench_transformers(folder, prompts, args.new_tokens, args.repeats)}
    rows["pdserve-eager"] = bench_engine(folder, prompts, args.new_tokens, args.repeats, eager=True)
    rows["pdserve-cuda-graphs"] = bench_engine(folder, prompts, args.new_tokens, args.repeats, eager=False)
    median = {k: statistics.median(v) for k, v in rows.items()}
    base = median["transformers-generate"]
    result = {
        "what": f"decode throughput, {args.requests} requests x {args.new_tokens} new tokens, prompts 1/4 tokens, "
        f"GPT-2-124M shape, dummy weights, bf16, ignore_eos; tokens/s of the whole batch",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "median_tok_per_s": median,
        "runs_tok_per_s": rows,
        "ratio_vs_transformers": {k: v / base for k, v in median.items()},
        "graph_step_ms_by_batch": GRAPH_STEP_MS,
        "engine_step_ms": 1e3 * args.requests / median["pdserve-cuda-graphs"],
    }
    for k, v in median.items():
        print(f"{k:22s} {v:10.0f} tok/s  x{v / base:5.2f}")
    print(f"decode step: engine {result['engine_step_ms']:.3f} ms, graph replay alone {GRAPH_STEP_MS} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
