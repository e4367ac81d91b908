#!/usr/bin/env python3
"""Tensor parallelism on two GPUs: the engine's decode step at TP 1 vs TP 2, the all-reduce of decode-sized
messages (NCCL eager, NCCL in a CUDA graph, torch symmetric memory's one-shot) and KV handoff bandwidth between
prefill and decode groups of TP 1 and 2. Each part starts its own processes, one per rank, rank r on GPU r;
every rank of a part runs the same steps in the same order and rank 0 reports. Prints a table, writes one JSON.
With --gpus 4 the handoff's decode ranks run on GPUs 2 and 3 (every pull crosses NVLink), and --shape llama-70b
gives the handoff Llama-3-70B's KV (its weights fit no single GPU: the decode part refuses it).

    python scripts/bench_tp.py --out bench/results/tp_h100x2.json
    python scripts/bench_tp.py --gpus 4 --shape llama-70b --parts handoff --out /tmp/handoff70b.json
    python scripts/bench_tp.py --smoke --out /tmp/tp_smoke.json   # tiny shapes on CPU: gloo, shm, no graphs

NOTE: NVLink multicast stays off (MULTICAST_OFF, set before any process starts): on a shared host a program
using it can take the GPUs out of service. Nothing here calls a multimem operation.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.core import parallel
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, torch_dtype
from pdserve.core.cuda_graphs import capture
from pdserve.core.engine import Engine
from pdserve.core.parallel import GROUP_TIMEOUT, AllReduceKind, ParallelConfig
from pdserve.core.sampling_params import SamplingParams
from pdserve.kvtransfer.base import merge_descriptors
from pdserve.kvtransfer.factory import make_sink, make_source
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.pool import KVPool, allocate_kv_pool

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LLAMA_8B: dict[str, Any] = dict(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
    vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
)  # fmt: skip
LLAMA_70B: dict[str, Any] = dict(
    hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
    vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
)  # fmt: skip
SHAPES = {"llama-8b": LLAMA_8B, "llama-70b": LLAMA_70B}
TINY_LLAMA: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    vocab_size=256, rope_theta=10000.0, max_position_embeddings=256,
)  # fmt: skip
HANDOFF_PAIRS = ((1, 1), (2, 2), (2, 1), (1, 2))
"""(prefill TP, decode TP) of each handoff; (1, 1) is the baseline of the ratios."""
PARTS = ("decode", "allreduce", "handoff")
PRELOAD = ["torch", "numpy", "pdserve.core.engine", "pdserve.kvtransfer.cuda_ipc", "pdserve.kvtransfer.shm"]
"""What the forkserver imports once for all the ranks it forks (none of these touches CUDA at import)."""


@dataclass(frozen=True)
class Setup:
    """What every part runs on and at which sizes (the GPU defaults, or --smoke's tiny ones on CPU)."""

    device: str
    """cuda (rank r on GPU r: NCCL, cuda_ipc, bf16) or cpu (gloo, shm, fp32)."""
    work_dir: str
    """Scratch folder: the model's config.json, rendezvous files, each part's rank-0 JSON."""
    model: dict[str, Any]
    """LlamaConfig fields of the model (dummy weights); the all-reduce and KV shapes follow from it."""
    context: int
    """Prompt tokens of every decoding sequence."""
    batches: tuple[int, ...]
    """Sequences decoding at once, one timing each."""
    warmup_steps: int
    """Decode steps run untimed once every sequence decodes."""
    steps: int
    """Timed decode steps per batch."""
    allreduce_batches: tuple[int, ...]
    """Rows of the all-reduced [rows, hidden] messages."""
    ops_per_graph: int
    """All-reduces chained in one timed run (and captured in one graph): a decode step of 32 layers has 64."""
    repeats: int
    """Timed runs of each all-reduce and handoff (median and min over them)."""
    pool_blocks: int
    """Blocks of each handoff pool (block 0 is the null block)."""
    handoff_blocks: int
    """Blocks of one handoff: a prompt of handoff_blocks * 16 tokens."""
    decode_gpu: int = 0
    """GPU of the handoff's decode rank 0 (its rank r on decode_gpu + r): 0 shares the prefill ranks' GPUs."""
    profile: bool = False
    """Also record each batch's captured decode step kernel by kernel (torch.profiler, rank 0)."""
    decode_runs: tuple[str, ...] = ()
    """The decode part's runs (DECODE_RUNS names; tp1 always among them)."""

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.device == "cuda" else "float32"

    @property
    def model_dir(self) -> str:
        return str(Path(self.work_dir) / "model")

    @property
    def max_tokens(self) -> int:
        """Every request's output budget: more than it generates before and during the timed steps."""
        return max(self.batches) + self.warmup_steps + self.steps + 8

    @property
    def kv(self) -> KVLayout:
        """The whole model's KV pool (TP 1) of a handoff; each rank's pool holds its TP share of the heads."""
        m = self.model
        head_dim = m["hidden_size"] // m["num_attention_heads"]
        layers, kv_heads = m["num_hidden_layers"], m["num_key_value_heads"]
        return KVLayout("bench", self.dtype, 16, layers, kv_heads, head_dim, num_blocks=self.pool_blocks)


def make_setup(args: argparse.Namespace, work_dir: str) -> Setup:
    if args.smoke:
        setup = Setup("cpu", work_dir, TINY_LLAMA, 24, (1, 4), 2, 4, (1, 8), 8, 3, 64, 16)
    else:
        setup = Setup("cuda", work_dir, SHAPES[args.shape], 1024, (1, 64), 10, args.steps, (1, 8, 64), 64, args.repeats,
                      1024, 256, decode_gpu=args.gpus - 2)  # fmt: skip
    return replace(setup, profile=args.profile, decode_runs=tuple(args.decode_runs))


def rank_device(setup: Setup, rank: int) -> torch.device:
    if setup.device == "cpu":
        torch.set_num_threads(1)  # NOTE: every rank shares the CPU
    return torch.device(f"cuda:{rank}" if setup.device == "cuda" else "cpu")


def rendezvous(setup: Setup, name: str) -> str:
    return f"file://{Path(setup.work_dir) / name}.rendezvous"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summary(seconds: list[float], unit: str) -> dict[str, float]:
    """median_{unit} and min_{unit} of seconds, unit ms or us."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    return {f"median_{unit}": statistics.median(seconds) * scale, f"min_{unit}": min(seconds) * scale}


def write_json(path: str | Path, value: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(value, indent=1))


def spawn(fn: Callable[..., None], nprocs: int, args: tuple[Any, ...], out: Path, timeout_s: float) -> dict[str, Any]:
    """fn(rank, *args, str(out)) in nprocs processes; what rank 0 last wrote to out, plus "error" when a process
    failed or the part ran past timeout_s (its processes killed then)."""
    ctx = mp.start_processes(fn, args=(*args, str(out)), nprocs=nprocs, join=False, start_method="forkserver")
    deadline, error = time.monotonic() + timeout_s, None
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not done after {timeout_s:.0f} s")
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc)[-3000:]}"
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    result = json.loads(out.read_text()) if out.exists() else {}
    return result if error is None else {**result, "error": error}


# --- 1. decode step at TP 1 and TP 2 -------------------------------------------------------------------------


def engine_config(setup: Setup, pc: ParallelConfig, device: torch.device) -> EngineConfig:
    model = ModelConfig.from_pretrained(setup.model_dir, dtype=setup.dtype, load_format="dummy")
    batch, block = max(setup.batches), setup.kv.block_size
    blocks_per_seq = -(-(setup.context + setup.max_tokens + 1) // block) + 1
    cache = CacheConfig(block_size=block, num_blocks=batch * blocks_per_seq + 16, enable_prefix_caching=False)
    # NOTE: a budget of one prompt and every decode row: each prefill pass takes one whole prompt
    scheduler = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=setup.context + batch)
    return EngineConfig(model, cache, scheduler, device=str(device), parallel=pc)


def decode_steps(engine: Engine, batch: int, setup: Setup, device: torch.device) -> dict[str, Any]:
    """Wall time of engine.step() while `batch` sequences of ~context tokens all decode. The control flow depends
    on counts alone (greedy, ignore_eos, logits gathered on every rank): every rank of a group runs the same passes."""
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=setup.max_tokens, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = torch.randint(0, engine.config.model.vocab_size, (setup.context,), generator=gen)
        engine.add_request(rid, prompt.tolist(), params)
    started: set[str] = set()
    while len(started) < batch:  # prefill passes (with the decode rows of the sequences already started)
        started.update(out.request_id for out in engine.step())
    for _ in range(setup.warmup_steps):
        engine.step()
    times = []
    sync(device)
    begin = time.perf_counter()
    for _ in range(setup.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    sync(device)
    mean_ms = (time.perf_counter() - begin) / setup.steps * 1e3
    running = len(engine.scheduler.running)
    kernels = step_kernels(engine, batch, device) if setup.profile and engine.runner.graphs is not None else None
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():  # the in-flight step
        engine.step()
    profiled = {} if kernels is None else {"kernels": kernels}
    return {**summary(times, "ms"), "mean_ms": mean_ms, "sequences_running": running, **profiled}


def step_kernels(engine: Engine, batch: int, device: torch.device, replays: int = 50) -> dict[str, Any]:
    """The GPU kernels of one replay of the captured decode step: per kernel name, launches and microseconds
    per step, and the step's wall time beside the sum (the gaps). Every rank replays alike (the sums in the
    step wait on the peers); only rank 0's numbers are kept."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.runner.graphs
    assert graphs is not None
    graphs.replay(batch)
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graphs.replay(batch)
        sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graphs.replay(batch)
    end.record()
    end.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and e.count]
    rows.sort(key=lambda e: -e.device_time_total)
    table = [{"name": e.key[:120], "per_step": e.count / replays, "us_per_step": e.device_time_total / replays}
             for e in rows]  # fmt: skip
    busy = sum(row["us_per_step"] for row in table)
    return {"step_us": start.elapsed_time(end) * 1e3 / replays, "kernel_us": busy, "kernels": table}


def decode_rank(rank: int, setup: Setup, size: int, kind: AllReduceKind, out: str) -> None:
    """Rank `rank` of an engine at TP size: decode steps timed at each batch; rank 0 writes them to out."""
    device = rank_device(setup, rank)
    pc = ParallelConfig(size, rank, all_reduce=kind)
    parallel.init_tp_group(pc, rendezvous(setup, f"decode_tp{size}_{kind}"), device)
    engine = Engine(engine_config(setup, pc, device))
    batches = {str(b): decode_steps(engine, b, setup, device) for b in setup.batches}
    if rank == 0:
        graphs, symmetric = engine.runner.graphs is not None, engine.runner.symmetric_all_reduce
        write_json(out, {"graphs": graphs, "symmetric_all_reduce": symmetric, "all_reduce": kind, "batch": batches})
    parallel.close_tp_group()


DECODE_RUNS: dict[str, tuple[int, AllReduceKind]] = {
    "tp1": (1, "fused"), "tp2": (2, "fused"), "tp2_one_shot": (2, "one_shot"), "tp2_nccl": (2, "nccl")
}  # fmt: skip
"""Name -> (TP size, how decode-sized sums run, core/parallel.py): TP 2 as served, then with the one-shot
all-reduce and a separate norm, then with NCCL for every sum."""


def decode_part(setup: Setup, timeout_s: float) -> dict[str, Any]:
    work = Path(setup.work_dir)
    runs = {k: DECODE_RUNS[k] for k in ("tp1", *setup.decode_runs) if k in DECODE_RUNS}
    part = {k: spawn(decode_rank, n, (setup, n, o), work / f"{k}.json", timeout_s) for k, (n, o) in runs.items()}
    one = part["tp1"].get("batch", {})

    def ratio(name: str) -> dict[str, float]:
        other = part[name].get("batch", {})
        return {b: other[b]["median_ms"] / one[b]["median_ms"] for b in one if b in other}

    return {**part, **{f"ratio_{name}_vs_tp1": ratio(name) for name in runs if name != "tp1"}}


# --- 2. all-reduce of [batch, hidden] on 2 ranks -------------------------------------------------------------

AllReduce = Callable[[torch.Tensor], None]
"""x -> x summed over the group, in place."""
Timing = Callable[[AllReduce, torch.Tensor, Setup], dict[str, Any]]
"""(op, x, setup) -> per-op time of op on x (eager_us, graph_us)."""


def timed_us(run: Callable[[], None], x: torch.Tensor, setup: Setup) -> dict[str, Any]:
    """Time per all-reduce of run() (ops_per_graph chained in-place all-reduces of x), and whether the chain is
    exact: from x = rank + 1, k all-reduces over w ranks give w(w+1)/2 * w^(k-1) (exact in bf16 at w = 2)."""
    world, ops = dist.get_world_size(), setup.ops_per_graph
    x.fill_(dist.get_rank() + 1)
    run()
    sync(x.device)
    correct = bool((x.float() == world * (world + 1) / 2 * float(world) ** (ops - 1)).all())
    x.zero_()  # NOTE: zeros stay zeros: the timed runs neither overflow nor depend on the data
    run()
    flag, times = torch.zeros(1, device=x.device), []
    for _ in range(setup.repeats):
        dist.all_reduce(flag)  # the ranks start each run together
        sync(x.device)
        start = time.perf_counter()
        run()
        sync(x.device)
        times.append((time.perf_counter() - start) / ops)
    return {**summary(times, "us"), "correct": correct}


def eager_us(op: AllReduce, x: torch.Tensor, setup: Setup) -> dict[str, Any]:
    def run() -> None:
        for _ in range(setup.ops_per_graph):
            op(x)

    return timed_us(run, x, setup)


def graph_us(op: AllReduce, x: torch.Tensor, setup: Setup) -> dict[str, Any]:
    """ops_per_graph all-reduces of x captured in one CUDA graph, replayed."""
    graph = torch.cuda.CUDAGraph()
    with capture(graph, None):
        for _ in range(setup.ops_per_graph):
            op(x)
    return timed_us(graph.replay, x, setup)


def symm_mem_all_reduce(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[AllReduce | None, str]:
    """The serving path's one-shot all-reduce (core/parallel.py), or None and why not (alike on both ranks)."""
    try:
        return parallel.OneShotAllReduce(dist.group.WORLD, numel, dtype, device), ""  # type: ignore[arg-type]
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def per_batch(timing: Timing, op: AllReduce, xs: dict[str, torch.Tensor], setup: Setup) -> dict[str, Any]:
    """timing of op at every message; {"skipped": why} when it raises (on both ranks alike: the same checks)."""
    try:
        return {batch: timing(op, x, setup) for batch, x in xs.items()}
    except Exception as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}


def nccl_all_reduce(x: torch.Tensor) -> None:
    dist.all_reduce(x)


def allreduce_rank(rank: int, setup: Setup, out: str) -> None:
    """One of 2 ranks: each method at each message; rank 0 writes after each method (a later hang keeps them)."""
    device = rank_device(setup, rank)
    parallel.init_tp_group(ParallelConfig(2, rank), rendezvous(setup, "allreduce"), device)
    dtype, hidden, cuda = torch_dtype(setup.dtype), setup.model["hidden_size"], device.type == "cuda"
    xs = {str(b): torch.zeros(b, hidden, dtype=dtype, device=device) for b in setup.allreduce_batches}
    op = "copy_ + torch.ops.symm_mem.one_shot_all_reduce_out"
    result: dict[str, Any] = {"backend": dist.get_backend(), "symm_mem_op": op}

    def record(name: str, op: AllReduce | None, timing: Timing, why_not: str) -> None:
        result[name] = {"skipped": why_not} if op is None else per_batch(timing, op, xs, setup)
        if rank == 0:  # NOTE: after each method: a later failure or hang keeps the figures so far
            write_json(out, result)

    record("nccl_eager", nccl_all_reduce, eager_us, "")
    record("nccl_graph", nccl_all_reduce if cuda else None, graph_us, "no CUDA")
    numel = hidden * max(setup.allreduce_batches)
    symm, why_not = symm_mem_all_reduce(numel, dtype, device) if cuda else (None, "no CUDA")
    record("symm_mem_one_shot_eager", symm, eager_us, why_not)
    record("symm_mem_one_shot_graph", symm, graph_us, why_not)
    parallel.close_tp_group()


def allreduce_part(setup: Setup, timeout_s: float) -> dict[str, Any]:
    return spawn(allreduce_rank, 2, (setup,), Path(setup.work_dir) / "allreduce.json", timeout_s)


# --- 3. KV handoff between a prefill group and a decode group -------------------------------------------------


def marks(layout: KVLayout, block_ids: torch.Tensor) -> torch.Tensor:  # [len(block_ids), KV heads of the rank]
    """What every element of a block's head holds in a prefill pool: global head * 16 + block id % 16 (exact)."""
    first, count = layout.heads
    return (torch.arange(first, first + count) * 16)[None, :] + (block_ids.cpu() % 16)[:, None]


def fill_marks(pool: KVPool) -> None:
    n = pool.layout.num_blocks
    values = marks(pool.layout, torch.arange(n)).to(device=pool.device, dtype=pool.tensor.dtype)
    pool.tensor.copy_(values.view(1, 1, n, 1, -1, 1).expand_as(pool.tensor))


def pulled_exactly(pool: KVPool, src: list[int], dst: list[int]) -> bool:
    """Whether the dst blocks of a decode pool hold the marks of the src blocks (first and last layer)."""
    got = pool.tensor[[0, -1]][:, :, torch.tensor(dst, device=pool.device)].float()  # [2, 2, n, 16, heads, dim]
    want = marks(pool.layout, torch.tensor(src)).float()
    low, high = got.amin(dim=(0, 1, 3, 5)).cpu(), got.amax(dim=(0, 1, 3, 5)).cpu()
    return bool(torch.equal(low, want) and torch.equal(high, want))


def gather(value: Any) -> list[Any]:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def block_ids(setup: Setup, seed: int) -> tuple[list[int], list[int]]:
    """Source and destination ids of one handoff: random, none twice, the same in every process."""
    rng, ids = np.random.default_rng(seed), np.arange(1, setup.pool_blocks)  # NOTE: block 0 is the null block
    src = rng.choice(ids, setup.handoff_blocks, replace=False).tolist()
    return src, rng.choice(ids, setup.handoff_blocks, replace=False).tolist()


def handoff_pair(role: str, rank: int, p: int, d: int, setup: Setup, device: torch.device) -> dict[str, Any]:
    """One (p, d) handoff, timed: each decode rank pulls its KV heads of the blocks from the prefill ranks holding
    them; the time runs from the first pull issued to the last rank's copy done."""
    size, transport = (p if role == "prefill" else d), ("cuda_ipc" if device.type == "cuda" else "shm")
    layout = replace(setup.kv, tp_size=size, tp_rank=rank) if rank < size else None
    source_pool = sink = None
    if layout is not None and role == "prefill":
        source_pool = allocate_kv_pool(layout, device, shared=device.type == "cpu")
        fill_marks(source_pool)
        sync(device)
    elif layout is not None:
        sink = make_sink(transport, allocate_kv_pool(layout, device, shared=False), layout)
    descriptors = gather(None if source_pool is None else make_source(transport, source_pool).descriptor())
    if sink is not None:
        sink.open(0, merge_descriptors([x for x in descriptors if x is not None]))
    spans = []
    for repeat in range(-2, setup.repeats):  # two untimed: block-copy plans, kernels, peer access
        src, dst = block_ids(setup, repeat + 2)
        dist.barrier()
        stamps = None
        if sink is not None:
            sync(device)
            start = time.perf_counter()  # NOTE: CLOCK_MONOTONIC, one clock for every process of the host
            sink.pull(0, src, dst).wait()
            stamps = (start, time.perf_counter())
        every = [s for s in gather(stamps) if s is not None]
        if repeat >= 0:
            spans.append(max(end for _, end in every) - min(begin for begin, _ in every))
    exact = all(gather(sink is None or pulled_exactly(sink.local_pool, src, dst)))
    if sink is not None:
        sink.close_all()
    dist.barrier()  # NOTE: every sink has let go of the prefill pools before they are freed
    if source_pool is not None:
        source_pool.close()
    nbytes = replace(setup.kv, num_blocks=setup.handoff_blocks).nbytes
    return {**summary(spans, "ms"), "GBps": nbytes / statistics.median(spans) / 1e9, "exact": exact}


def handoff_rank(index: int, setup: Setup, out: str) -> None:
    """Process index of 4: prefill rank index (0, 1) or decode rank index - 2 (2, 3), rank r on GPU r; process 0
    writes. Prefill and decode pools live in different processes: a CUDA IPC handle opens only in another one."""
    role, rank = ("prefill", "decode")[index // 2], index % 2
    device = rank_device(setup, rank + (setup.decode_gpu if role == "decode" else 0))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init = rendezvous(setup, "handoff")
    dist.init_process_group("gloo", init_method=init, world_size=4, rank=index, timeout=GROUP_TIMEOUT)
    result: dict[str, Any] = {"bytes": replace(setup.kv, num_blocks=setup.handoff_blocks).nbytes}
    for p, d in HANDOFF_PAIRS:
        result[f"p{p}_d{d}"] = handoff_pair(role, rank, p, d, setup, device)
        if index == 0:
            write_json(out, result)
    dist.destroy_process_group()


def handoff_part(setup: Setup, timeout_s: float) -> dict[str, Any]:
    part = spawn(handoff_rank, 4, (setup,), Path(setup.work_dir) / "handoff.json", timeout_s)
    base = part.get("p1_d1", {}).get("GBps")
    for p, d in HANDOFF_PAIRS:
        if base and f"p{p}_d{d}" in part:
            part[f"p{p}_d{d}"]["ratio_vs_p1_d1"] = part[f"p{p}_d{d}"]["GBps"] / base
    return part


# --- the run -------------------------------------------------------------------------------------------------


def print_table(result: dict[str, Any]) -> None:
    decode = result.get("decode", {})
    for tp in DECODE_RUNS:
        for b, row in decode.get(tp, {}).get("batch", {}).items():
            print(f"decode step {tp:12s} batch {b:>3}: {row['median_ms']:8.3f} ms median, {row['min_ms']:8.3f} min")
    for name in (n for n in DECODE_RUNS if n != "tp1"):
        for b, ratio in decode.get(f"ratio_{name}_vs_tp1", {}).items():
            print(f"decode step {name}/tp1 batch {b:>3}: {ratio:.3f}x")
    for method, rows in result.get("allreduce", {}).items():
        if isinstance(rows, dict) and "skipped" in rows:
            print(f"all-reduce {method:24s} skipped: {rows['skipped']}")
        elif isinstance(rows, dict):
            for b, row in rows.items():
                print(f"all-reduce {method:24s} [{b:>2}, hidden]: {row['median_us']:8.1f} us, correct {row['correct']}")
    for pair, row in result.get("handoff", {}).items():
        if isinstance(row, dict):
            print(f"handoff {pair}: {row['GBps']:7.1f} GB/s, {row['median_ms']:.3f} ms, exact {row['exact']}")
    for name, part in [("run", result), *((n, result.get(n, {})) for n in PARTS)]:
        if "error" in part:
            print(f"{name} failed: {part['error']}", file=sys.stderr)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (gloo, shm, eager): every CPU path")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--gpus", type=int, choices=[2, 4], default=2, help="4: the handoff's decode ranks on GPUs 2, 3")
    p.add_argument("--shape", choices=list(SHAPES), default="llama-8b", help="the model (llama-70b: handoff only)")
    p.add_argument("--steps", type=int, default=100, help="timed decode steps per batch")
    p.add_argument("--repeats", type=int, default=20, help="timed runs of each all-reduce and handoff")
    p.add_argument(
        "--decode-runs",
        nargs="+",
        choices=list(DECODE_RUNS),
        default=list(DECODE_RUNS),
        help="the decode part's runs (tp1, the baseline, always runs)",
    )
    p.add_argument("--profile", action="store_true", help="decode part: record each step's kernels (rank 0)")
    p.add_argument("--part-timeout", type=float, default=900.0, help="seconds before a part's processes are killed")
    args = p.parse_args()
    if args.shape == "llama-70b" and set(args.parts) != {"handoff"}:
        p.error("--shape llama-70b fits no single GPU at TP 1: only --parts handoff")
    return args


def header(setup: Setup) -> dict[str, Any]:
    """What ran: on which GPUs, which torch, the exact command, the sizes."""
    return {
        "what": "TP 1 vs TP 2 on 2 GPUs: the engine's decode step (dummy weights), all-reduce of [batch, hidden] "
        "messages, KV handoff between prefill and decode groups; rank r on GPU r",
        "gpu": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if setup.device == "cuda"
        else ["cpu"],
        "torch": torch.__version__,
        "command": shlex.join([sys.executable, *sys.argv]),
        "env": MULTICAST_OFF,
        "setup": {k: v for k, v in vars(setup).items() if k != "work_dir"} | {"dtype": setup.dtype},
        "kv_layout": vars(setup.kv),
    }


def main() -> int:
    args = parse_args()
    os.environ.update(MULTICAST_OFF)  # NOTE: before any process (or CUDA context) exists
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    setup = make_setup(args, tempfile.mkdtemp(prefix="bench_tp_"))
    if setup.device == "cuda" and torch.cuda.device_count() < args.gpus:
        print(f"needs {args.gpus} CUDA devices (--smoke runs on CPU)", file=sys.stderr)
        return 2
    Path(setup.model_dir).mkdir()
    write_json(Path(setup.model_dir) / "config.json", {"model_type": "llama", **setup.model})  # a LlamaConfig
    parts = {"decode": decode_part, "allreduce": allreduce_part, "handoff": handoff_part}
    result: dict[str, Any] = {}
    try:
        for name in args.parts:
            result[name] = parts[name](setup, args.part_timeout)
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        shutil.rmtree(setup.work_dir, ignore_errors=True)
    result = header(setup) | result
    write_json(args.out, result)
    print_table(result)
    return 1 if "error" in result or any("error" in result.get(name, {}) for name in PARTS) else 0


if __name__ == "__main__":
    sys.exit(main())
