#!/usr/bin/env python3
"""How fast this host runs the kinds of work on a prefill's critical path: pure Python, small numpy calls, torch
calls on CPU tensors, the engine's own host code (on the CPU, forward stubbed), and (with a GPU) CUDA events, a
pinned copy and graph launches of 1 and 200 kernels.

The engine's host code ran 6-10x slower on the device tool's GPU hosts than on the 2-core CPU VM
(docs/benchmarks.md, "GPU busy was the span"); run this on both to see which kind of work is slow, and why.

    python scripts/bench_host_ops.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def per_call_us(fn: Callable[[], object], number: int = 2000, repeat: int = 5) -> float:
    """Best of `repeat` means over `number` calls, in microseconds."""
    return round(min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6, 3)


def host_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"python": sys.version.split()[0], "machine": platform.machine(), "nproc": os.cpu_count()}
    facts["sched_affinity"] = len(os.sched_getaffinity(0))
    for name, path in (("cpu.max", "/sys/fs/cgroup/cpu.max"), ("loadavg", "/proc/loadavg")):
        try:
            facts[name] = Path(path).read_text().strip()
        except OSError:
            facts[name] = None
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        facts["cpu"] = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
        mhz = [float(line.split(":", 1)[1]) for line in info if line.startswith("cpu MHz")]
        facts["cpu_mhz_min_max"] = [min(mhz), max(mhz)] if mhz else None
    except OSError:
        facts["cpu"] = None
    facts["torch_threads"] = torch.get_num_threads()
    return facts


def cpu_ops() -> dict[str, float]:
    ids = np.arange(4000, dtype=np.int32)
    blocks = list(range(1, 252))
    small = [0, 4000]
    src, dst = torch.zeros(33_000, dtype=torch.uint8), torch.zeros(33_000, dtype=torch.uint8)
    return {
        "python_loop_1000": per_call_us(lambda: sum(i for i in range(1000)), 500),
        "tolist_4000_int32": per_call_us(ids.tolist),
        "np_array_251_list": per_call_us(lambda: np.array(blocks, dtype=np.int32)),
        "np_array_2": per_call_us(lambda: np.array(small, dtype=np.int32)),
        "np_minmax_4000": per_call_us(lambda: (ids.min(), ids.max())),
        "torch_empty_1": per_call_us(lambda: torch.empty(1)),
        "torch_copy_33k_cpu": per_call_us(lambda: dst.copy_(src)),
    }


def cuda_ops() -> dict[str, float]:
    event, stream = torch.cuda.Event(), torch.cuda.current_stream()
    event.record()
    pinned = torch.zeros(33_000, dtype=torch.uint8, pin_memory=True)
    dev = torch.zeros(33_000, dtype=torch.uint8, device="cuda")
    x = torch.zeros(1024, device="cuda")
    graphs = {}
    for kernels in (1, 200):
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(kernels):
                x.add_(1.0)
        graphs[kernels] = graph

    def copy() -> None:
        dev.copy_(pinned, non_blocking=True)

    def replay(kernels: int) -> Callable[[], None]:
        def run() -> None:
            graphs[kernels].replay()
            stream.synchronize()

        return run

    out = {
        "event_record": per_call_us(event.record),
        "event_synchronize_done": per_call_us(event.synchronize),
        "copy_33k_pinned_to_device_async": per_call_us(copy),
        "stream_synchronize_idle": per_call_us(stream.synchronize),
        "graph_replay_sync_1_kernel": per_call_us(replay(1), 500),
        "graph_replay_sync_200_kernels": per_call_us(replay(200), 200),
    }
    torch.cuda.synchronize()
    return out


ENGINE_VOCAB = 128256
"""The engine part's vocabulary (the 1B Llama shape's): ids past 256 are new int objects in a Python list."""


def engine_ops(repeats: int = 200) -> dict[str, float]:
    """Median host time of Engine.generate on the CPU (a 2-layer Llama of ENGINE_VOCAB ids, dummy weights), its
    forward pass replaced by a stub: from the call to the pass's launch, and the whole call, for 4000- and
    128-token prompts (one token out, no prefix cache: bench_prefill.py's setting)."""
    import statistics
    import tempfile

    from transformers import LlamaConfig

    from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from pdserve.core.engine import Engine
    from pdserve.core.sampling_params import SamplingParams

    folder = Path(tempfile.mkdtemp())
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    LlamaConfig(**shape, num_key_value_heads=2, vocab_size=ENGINE_VOCAB, max_position_embeddings=8192).save_pretrained(
        folder
    )
    out: dict[str, float] = {}
    rng, launched = np.random.default_rng(0), [0]
    for tokens in (4000, 128):
        model = ModelConfig.from_pretrained(folder, load_format="dummy")
        cache = CacheConfig(num_blocks=tokens // 16 + 64, enable_prefix_caching=False)
        engine = Engine(EngineConfig(model, cache, SchedulerConfig(max_num_batched_tokens=4096), device="cpu"))
        logits = torch.zeros(1, ENGINE_VOCAB)

        def stub(plan: Any, sampled_rows: Any = None, engine: Engine = engine, logits: torch.Tensor = logits) -> Any:
            engine.runner._host_inputs(plan)
            launched[0] = time.perf_counter_ns()
            return logits

        engine.runner.execute = stub  # type: ignore[method-assign]
        one = SamplingParams(temperature=0.0, max_tokens=1)
        prompts = [rng.integers(0, ENGINE_VOCAB, tokens).astype(np.int32) for _ in range(repeats)]
        for regime, between in BETWEEN_CALLS.items():
            if regime and tokens != 4000:
                continue
            to_launch, whole = [], []
            for prompt in prompts:
                between()
                start = time.perf_counter_ns()
                engine.generate([prompt], one)
                whole.append(time.perf_counter_ns() - start)
                to_launch.append(launched[0] - start)
            name = f"generate_{tokens}{regime}"
            out[f"{name}_call_to_launch"] = round(statistics.median(to_launch[repeats // 4 :]) / 1e3, 1)
            out[f"{name}_whole"] = round(statistics.median(whole[repeats // 4 :]) / 1e3, 1)
    return out


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _gpu_wait(seconds: float) -> None:
    if torch.cuda.is_available():
        torch.cuda._sleep(int(seconds * 1.5e9))  # ~cycles at 1.5 GHz; waited on by the driver, as a pass's token is
        torch.cuda.synchronize()


BETWEEN_CALLS: dict[str, Callable[[], None]] = {
    "": lambda: None,
    "_after_sleep_16ms": lambda: time.sleep(0.016),
    "_after_spin_16ms": lambda: _spin(0.016),
    "_after_gpu_wait_16ms": lambda: _gpu_wait(0.016),
}
"""What each call of the engine part follows: nothing (back to back), a 16 ms sleep, a 16 ms busy loop, or a
16 ms GPU kernel waited on by the CUDA driver (a 4000-token pass's time): a host whose Python slows after an idle
wait runs a real pass's host part slower than back-to-back calls show."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result: dict[str, Any] = {"host": host_facts(), "cpu_us": cpu_ops(), "engine_cpu_us": engine_ops()}
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
        result["cuda_us"] = cuda_ops()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
