#!/usr/bin/env python3
"""Prefill latency of one long prompt through the engine vs transformers, same GPU, same process.

Default shape (issue 4): Llama with hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192,
vocab 128256, bf16, seeded dummy weights, a 4000-token prompt. Prints a table and writes JSON.

    python scripts/bench_prefill.py --out bench/results/prefill.json

An engine call adds the request and steps until its first token is on the host (TTFT, "ttft_median_ms"), then
flushes (the finished request's blocks go back): "median_ms" is the whole call. transformers' call is its
forward alone (logits of the last position; no sampling, no copy to the host).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.core.messages import pack_token_ids, unpack_token_ids
from pdserve.core.sampling_params import SamplingParams

SHAPE: dict[str, Any] = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)


def write_config(folder: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(**SHAPE).save_pretrained(folder)
    return folder


def time_cuda(fn, repeats: int, first: list[float] | None = None) -> list[float]:  # type: ignore[no-untyped-def]
    """Each call's wall time (ms); fn may return when (perf_counter) its first token was out, kept in `first`."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        first_at = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        if first is not None and first_at is not None:
            first.append((first_at - start) * 1e3)
    return times


TTFT: dict[str, list[float]] = {}
"""Each engine run's times to the first token (ms), by run name."""


def bench_engine(
    folder: Path, tokens: int, repeats: int, backend: str, eager: bool = False, name: str = ""
) -> list[float]:
    """engine.generate of one prompt of `tokens` tokens (max_tokens 1), timed per call."""
    model = ModelConfig.from_pretrained(folder, dtype="bfloat16", load_format="dummy")
    cfg = EngineConfig(
        model,
        CacheConfig(num_blocks=tokens // 16 + 64, enable_prefix_caching=False),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=tokens),
        device="cuda",
        attention_backend=backend,  # type: ignore[arg-type]
        enforce_eager=eager,
    )
    engine = Engine(cfg)
    gen = torch.Generator().manual_seed(0)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    # NOTE: prompts are made before the clock starts (transformers' baseline also gets its ids ready-made), as
    # the int32 array a prefill worker unpacks from its GenerateCmd (the ids travel packed from the router)
    vocab = SHAPE["vocab_size"]
    # NOTE: reused after repeats + 16 calls (the profiles' extra calls): the bench's prefix cache is off
    made = [torch.randint(0, vocab, (tokens,), generator=gen).tolist() for _ in range(repeats + 16)]
    prompts = itertools.cycle([unpack_token_ids(pack_token_ids(ids)) for ids in made])

    ids = itertools.count()

    def run() -> float:
        engine.add_request(f"bench-{next(ids)}", next(prompts), one)
        while not engine.step():
            pass
        first_at = time.perf_counter()
        engine.flush_commits()
        return first_at

    time_cuda(run, 3)
    times = time_cuda(run, repeats, TTFT.setdefault(name or f"pdserve-{backend}", []))
    if HOST_TIMELINE and backend == "triton" and not eager:
        DETAILS.setdefault("host_timeline_us", {})[tokens] = print_host_timeline(run)
    if PROFILE:
        DETAILS.setdefault("profile", {})[f"pdserve-{backend}"] = print_profile(f"pdserve-{backend}", run)
    if TRACE and backend == "triton":
        export_trace(Path(TRACE), run)
    if HOST_PROFILE and backend == "triton":
        print_host_profile(run)
    return times


PROFILE = False
HOST_PROFILE = False
DETAILS: dict[str, dict[Any, Any]] = {}
"""What --profile and --host-timeline saw, by run: written to the JSON beside the medians."""
HOST_TIMELINE = False
TRACE = ""

TIMELINE_STEPS = {
    "core.engine:Engine": ("add_request", "_accept"),
    "core.scheduler:Scheduler": ("schedule",),
    "core.model_runner:ModelRunner": ("_host_inputs", "_to_device"),
    "core.prefill_graphs:PrefillGraphs": ("_load",),
    "torch.cuda:CUDAGraph": ("replay",),
    "core.sampler:Sampler": ("sample",),
}
"""The engine steps of a prefill whose host time print_host_timeline reports, by class."""


def print_host_timeline(fn, calls: int = 20) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Median start and end (us after the call began) of each engine step over a few calls: where the host time
    before the first kernel and after the last one goes (no profiler: its own overhead would blur them).
    Returns the medians: {"wall": us, step: [start, end]}."""
    import importlib

    t0 = [0]
    seen: dict[str, list[tuple[float, float]]] = {}
    originals = []
    for where, names in TIMELINE_STEPS.items():
        module, cls_name = where.split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        for name in names:
            originals.append((cls, name, getattr(cls, name)))

    def timed(name: str, method):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter_ns()
            out = method(*args, **kwargs)
            seen.setdefault(name, []).append(((start - t0[0]) / 1e3, (time.perf_counter_ns() - t0[0]) / 1e3))
            return out

        return call

    for cls, name, method in originals:
        setattr(cls, name, timed(name, method))
    try:
        walls = []
        for _ in range(calls):
            torch.cuda.synchronize()
            t0[0] = time.perf_counter_ns()
            fn()
            torch.cuda.synchronize()
            walls.append((time.perf_counter_ns() - t0[0]) / 1e3)
    finally:
        for cls, name, method in originals:
            setattr(cls, name, method)
    timeline: dict[str, Any] = {"wall": round(statistics.median(walls), 1)}
    print(f"==== host timeline, {calls} calls: wall median {timeline['wall']:.1f} us")
    for name, spans in sorted(seen.items(), key=lambda kv: statistics.median(s for s, _ in kv[1])):
        start, end = statistics.median(s for s, _ in spans), statistics.median(e for _, e in spans)
        print(f"  {name:14s} start {start:9.1f} us  end {end:9.1f} us")
        timeline[name] = [round(start, 1), round(end, 1)]
    return timeline


def print_host_profile(fn, calls: int = 10) -> None:  # type: ignore[no-untyped-def]
    """Python functions by own time over a few calls: where the host's share of a prefill goes."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    print(f"==== host profile, {calls} calls")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def export_trace(path: Path, fn) -> None:  # type: ignore[no-untyped-def]
    """A Chrome trace (host ops and GPU kernels on one timeline) of one call, for chrome://tracing or Perfetto."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))


def print_profile(name: str, fn) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The GPU kernels of one call by total time, and where the GPU sat idle (to see where a prefill's time goes).
    Returns print_gaps' summary with "kernels_us": {kernel: [GPU us, calls]} for the top kernels."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        wall = time.perf_counter()
        with record_function(CALL):
            fn()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - wall) * 1e3
    print(f"==== {name}")
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    summary = print_gaps(prof, wall)
    on_gpu = sorted(
        (a for a in averages if a.device_type.name == "CUDA" and a.key != CALL), key=lambda a: -a.self_device_time_total
    )
    summary["kernels_us"] = {a.key: [round(a.self_device_time_total, 1), a.count] for a in on_gpu[:KERNELS_KEPT]}
    return summary


KERNELS_KEPT = 16
"""GPU kernels of a profiled call written to the JSON (by total time)."""


def print_gaps(prof, wall_ms: float) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """GPU busy time (union of kernel intervals) against the call's wall time, and the longest idle gaps; returns
    {"wall_ms", "first_to_last_kernel_ms", "gpu_busy_ms", "host_before_first_kernel_us",
    "host_after_last_kernel_us"} (the host's where the call's range was recorded)."""
    from torch.autograd import DeviceType

    # NOTE: the call's record_function range has a GPU-side twin that spans its first to last kernel: counted as
    # busy, it made "GPU busy" equal the span and hid every gap inside it (figures before 2026-11-25, later)
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.name != CALL
    )
    if not kernels:
        return {"wall_ms": round(wall_ms, 3)}
    busy, gaps, end, last = 0.0, [], kernels[0][0], ""
    for start, stop, kname in kernels:
        if start > end:
            gaps.append((start - end, last, kname))
        busy += max(0.0, stop - max(start, end))
        end, last = max(end, stop), kname
    span = (end - kernels[0][0]) / 1e3
    print(f"wall {wall_ms:.2f} ms, first->last kernel {span:.2f} ms, GPU busy {busy / 1e3:.2f} ms")
    summary: dict[str, Any] = {"wall_ms": round(wall_ms, 3), "first_to_last_kernel_ms": round(span, 3)}
    summary["gpu_busy_ms"] = round(busy / 1e3, 3)
    call = next((e for e in prof.events() if e.name == CALL), None)
    if call is not None:
        pre, post = kernels[0][0] - call.time_range.start, call.time_range.end - end
        print(f"host before the first kernel {pre:.1f} us, after the last {post:.1f} us")
        summary |= {"host_before_first_kernel_us": round(pre, 1), "host_after_last_kernel_us": round(post, 1)}
        print_runtime_calls(prof, call.time_range.start)
    for gap, before, after in sorted(gaps, reverse=True)[:8]:
        print(f"  idle {gap:8.1f} us between {before[:50]!r} and {after[:50]!r}")
    return summary


CALL = "bench_call"
"""The profiler range around one timed call."""


def print_runtime_calls(prof, t0: float, head: int = 25, tail: int = 8) -> None:  # type: ignore[no-untyped-def]
    """CUDA runtime calls of one profiled call (launches, copies, syncs) at their offset from its start."""
    calls = sorted(
        (e.time_range.start - t0, e.time_range.elapsed_us(), e.name)
        for e in prof.events()
        if e.name.startswith(("cuda", "cu")) and e.device_type.name == "CPU"
    )
    shown = calls if len(calls) <= head + tail else calls[:head] + [(float("nan"), 0.0, "...")] + calls[-tail:]
    for at, took, name in shown:
        print(f"  +{at:9.1f} us {took:8.1f} us  {name}")


def bench_transformers(folder: Path, tokens: int, repeats: int) -> list[float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(0, SHAPE["vocab_size"], (1, tokens), device="cuda")

    def run() -> None:
        with torch.no_grad():
            model(ids, logits_to_keep=1)

    time_cuda(run, 3)
    return time_cuda(run, repeats)


def pointer_loads(folder: Path, tokens: int, repeats: int) -> list[float]:
    """The Triton backend with the prefill kernel's new-token K/V read by pointer loads instead of TMA (the path
    GPUs before Hopper take), for an in-model comparison: standalone sweeps rank the two differently."""
    import pdserve.kernels.prefill_attention as pa

    saved = pa.tma_supported
    pa.tma_supported = lambda *tensors: False
    try:
        return bench_engine(folder, tokens, repeats, "triton", name="pdserve-triton-pointer-loads")
    finally:
        pa.tma_supported = saved


def graphs_vs_eager(folder: Path, lengths: list[int]) -> dict[int, dict[str, float]]:
    """Prefill latency of short prompts with prefill CUDA graphs and eagerly (host launch overhead), same process."""
    rows = {}
    for n in lengths:
        row = {
            mode: statistics.median(bench_engine(folder, n, 20, "triton", mode == "eager", f"{n}-tokens-{mode}"))
            for mode in ("graphs", "eager")
        }
        rows[n] = row
        print(f"{n:6d} tokens: graphs {row['graphs']:7.2f} ms, eager {row['eager']:7.2f} ms")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true", help="print each engine run's top GPU kernels")
    p.add_argument("--trace", default="", help="write a Chrome trace of one Triton-backend run here")
    p.add_argument("--host-profile", action="store_true", help="print a cProfile of Triton-backend runs")
    p.add_argument("--host-timeline", action="store_true", help="print when each engine step runs (graphed runs)")
    p.add_argument("--pointer-loads", action="store_true", help="also run the Triton backend without TMA loads")
    p.add_argument("--lengths", default="", help="comma-separated prompt lengths: prefill graphs vs eager at each")
    args = p.parse_args()
    global PROFILE, HOST_PROFILE, HOST_TIMELINE, TRACE
    PROFILE, HOST_PROFILE, HOST_TIMELINE, TRACE = args.profile, args.host_profile, args.host_timeline, args.trace
    folder = write_config(Path(tempfile.mkdtemp()))
    hf = bench_transformers(folder, args.tokens, args.repeats)
    rows = {"transformers": hf}
    for backend in ("torch", "triton"):
        rows[f"pdserve-{backend}"] = bench_engine(folder, args.tokens, args.repeats, backend)
    if args.pointer_loads:
        rows["pdserve-triton-pointer-loads"] = pointer_loads(folder, args.tokens, args.repeats)
    result: dict[str, Any] = {
        "what": f"prefill latency, {args.tokens} tokens, bf16, Llama shape {SHAPE}",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "median_ms": {k: statistics.median(v) for k, v in rows.items()},
        "p90_ms": {k: sorted(v)[int(0.9 * (len(v) - 1))] for k, v in rows.items()},
        "ttft_median_ms": {k: statistics.median(v) for k, v in TTFT.items() if v},
    }
    base = result["median_ms"]["transformers"]
    result["ratio_vs_transformers"] = {k: v / base for k, v in result["median_ms"].items()}
    for k, v in result["median_ms"].items():
        ttft = result["ttft_median_ms"].get(k)
        print(f"{k:20s} median {v:8.2f} ms" + (f"  (first token {ttft:.2f} ms)" if ttft else ""))
    if args.lengths:
        result["graphs_vs_eager_median_ms"] = graphs_vs_eager(folder, [int(n) for n in args.lengths.split(",")])
    result |= DETAILS
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
