#!/usr/bin/env python3
"""A colocated worker's mixed steps (running decodes beside a prompt's chunk) through the engine, split into the
forward pass's GPU span and the rest (host), beside the planner's model of them from a profile:
decode(B, context) + prefill(chunk + B) - prefill(B) + the chunk's prefix cost (router/plan/simulate.py
StepCost.mixed).

    python scripts/bench_mixed_step.py --profile bench/results/profile_llama8b_h200_2026-11-27.json \\
        --out bench/out/mixed_step.json
    python scripts/bench_mixed_step.py --smoke --out /tmp/mixed_step.json   # tiny shape on CPU: runs end to end

Per (chunk, batch, context): `batch` requests of `context` prompt tokens decode; `steps` pure decode steps are
timed; then one prompt of PROMPT_CHUNKS chunks arrives and each step that carries one of its chunks is timed.
A step's time is engine.step()'s wall time with the device synchronized after it; its GPU span is CUDA events
around ModelRunner.execute (on CPU, execute's wall time); host = step - span. The engine is the colocated
worker's (pdserve-cluster --colocated --prefill-chunk-size C --max-num-batched-tokens C): one engine per chunk
size, 128 sequences, dummy weights, CUDA graphs (a decode worker's prefill graphs have decode slots).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_moe import TINY, stats, sync, write_model
from profile_layout import PassSpans, prompt

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.scheduler import StepPlan
from pdserve.router.plan.profile import Profile
from pdserve.router.plan.simulate import StepCost

PROMPT_CHUNKS = 4
"""Chunks of the prompt that arrives at each point: its later chunks attend to a longer cached prefix."""


@dataclasses.dataclass(frozen=True)
class Grid:
    chunks: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    steps: int
    """Timed pure decode steps per point."""
    max_num_seqs: int


GPU_GRID = Grid((512, 2048), (1, 16, 64), (512, 4096), 10, 128)
SMOKE_GRID = Grid((16,), (1, 4), (24,), 3, 8)


def make_engine(folder: Path, device: str, chunk: int, grid: Grid) -> Engine:
    dtype = "float32" if device == "cpu" else "bfloat16"
    model = ModelConfig.from_pretrained(folder, dtype=dtype, load_format="dummy")
    cache = CacheConfig(num_blocks=512 if device == "cpu" else None, enable_prefix_caching=False)
    sched = SchedulerConfig(max_num_seqs=grid.max_num_seqs, max_num_batched_tokens=chunk, prefill_chunk_size=chunk)
    return Engine(EngineConfig(model, cache, sched, device=device))


def timed_step(engine: Engine, spans: PassSpans) -> tuple[float, list[tuple[float, StepPlan]]]:
    """One engine.step(): its wall time (ms, device synchronized) and its passes' spans with their plans."""
    device = engine.runner.device
    sync(device)
    start = time.perf_counter()
    engine.step()
    sync(device)
    return (time.perf_counter() - start) * 1e3, spans.take()


def measure_point(engine: Engine, spans: PassSpans, batch: int, context: int, grid: Grid,
                  predict: Callable[[int, int, float, int], tuple[float, float]] | None) -> dict[str, Any]:  # fmt: skip
    """One (batch, context) point of the engine's chunk size: pure decode steps, then the steps of a prompt."""
    chunk = engine.config.scheduler.prefill_chunk_size or engine.config.scheduler.max_num_batched_tokens
    long = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    ids = [f"d{batch}-{context}-{k}" for k in range(batch)]
    for k, rid in enumerate(ids):
        engine.add_request(rid, prompt(engine, context, k), long)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    spans.take()
    decode = [timed_step(engine, spans) for _ in range(grid.steps)]
    length = min(PROMPT_CHUNKS * chunk, engine.config.model.max_model_len - 1)
    engine.add_request("prompt", prompt(engine, length, 10_000), SamplingParams(max_tokens=1))
    mixed = []
    while any(r.request_id == "prompt" for r in (*engine.scheduler.waiting, *engine.scheduler.running)):
        wall, passes = timed_step(engine, spans)
        plans = [plan for _, plan in passes if any(c.req.request_id == "prompt" for c in plan.chunks)]
        if not plans:
            continue  # NOTE: a step that only read the decodes in flight
        chunks = [c for c in plans[0].chunks if c.req.request_id == "prompt"]
        decodes = sum(1 for c in plans[0].chunks if c.num_tokens == 1)
        span = sum(s for s, _ in passes)
        row = {"tokens": chunks[0].num_tokens, "prefix": chunks[0].req.num_computed_tokens - chunks[0].num_tokens,
               "decodes": decodes, "step_ms": round(wall, 4), "gpu_ms": round(span, 4),
               "host_ms": round(wall - span, 4)}  # fmt: skip
        if predict is not None:
            row["predicted_ms"] = round(predict(row["tokens"], decodes, context + grid.steps, row["prefix"])[1], 4)
        mixed.append(row)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    engine.flush_commits()
    walls, gpu = [w for w, _ in decode], [s for _, passes in decode for s, _ in passes]
    out: dict[str, Any] = {
        "chunk": chunk, "batch": batch, "context": context,
        "decode": {**stats("step", walls), "median_gpu_ms": round(statistics.median(gpu), 4) if gpu else None},
        "mixed": mixed,
    }  # fmt: skip
    if predict is not None:
        out["decode"]["predicted_ms"] = round(predict(0, batch, context + grid.steps, 0)[0], 4)
    return out


def predictor(path: str | None) -> Callable[[int, int, float, int], tuple[float, float]] | None:
    """(tokens, decodes, context, prefix) -> the planner's (decode step, mixed step) in ms, from the profile at
    path."""
    if path is None:
        return None
    cost = StepCost(Profile.read(path))

    def predict(tokens: int, batch: int, ctx: float, prefix: int) -> tuple[float, float]:
        return cost.decode(batch, ctx) * 1e3, cost.mixed(tokens, batch, ctx, cost.prefix(tokens, prefix)) * 1e3

    return predict


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-8b", help="a make_bench_model.py shape")
    p.add_argument("--profile", default=None, help="the planner's profile of this GPU: predictions beside each step")
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU, float32: runs end to end")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = "cpu" if args.smoke else "cuda"
    grid = SMOKE_GRID if args.smoke else GPU_GRID
    scratch = Path(tempfile.mkdtemp(prefix="bench_mixed_step_"))
    folder = write_model(args.shape, scratch, dict(TINY) if args.smoke else {})
    predict = predictor(args.profile)
    points = []
    for chunk in grid.chunks:
        engine = make_engine(folder, device, chunk, grid)
        spans = PassSpans(engine)
        for context in grid.contexts:
            for batch in grid.batches:
                points.append(measure_point(engine, spans, batch, context, grid, predict))
                m = points[-1]["mixed"]
                print(
                    f"chunk {chunk} batch {batch} context {context}: decode {points[-1]['decode']['median_step_ms']}"
                    f" ms, mixed "
                    + ", ".join(
                        f"{r['step_ms']:.2f} ({r['gpu_ms']:.2f} GPU, {r.get('predicted_ms')} planned)" for r in m
                    ),
                    flush=True,
                )
        del engine
    doc = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "command": shlex.join([sys.executable, *sys.argv]), "shape": args.shape, "smoke": args.smoke,
           "profile": args.profile, "grid": dataclasses.asdict(grid), "points": points}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
