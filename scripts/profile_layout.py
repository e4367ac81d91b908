#!/usr/bin/env python3
"""The planner's profile of a worker (router/plan/profile.py): the engine's time to the first token of one prompt
per length, and its decode step time per batch size and context, plus the KV tokens its pool holds. --tp N
profiles a worker of N GPUs (one process per rank, rank r on GPU r) and adds it to the "tp" section of the
TP-1 profile already at --out (same shape, same GPU), so profile TP 1 first. --chunks adds to it the time of a
pass computing a chunk of a prompt whose earlier tokens are cached, per chunk size and prefix (a chunk's
attention reads its prefix: Profile.prefix_cost); --mps 30,50,70 each role's step time at those SM shares under
MPS over its time with the whole GPU, alone and with the other role running on the rest of it (Profile.slowdown; a
prefill at the step budget, a decode step of 64 x 2048);
--handoff the decode GPU's copy of a prompt's KV from the prefill GPU's pool per prompt length (GPU 1 -> GPU 0
where two are visible, the copy a handed-off request waits for: router/plan/simulate.py DecodeWorker).

    python scripts/profile_layout.py --shape llama-8b --gpus 2 --out bench/out/profile-llama-8b.json
    python scripts/profile_layout.py --shape llama-8b --tp 2 --out bench/out/profile-llama-8b.json
    python scripts/profile_layout.py --shape llama-8b --chunks --out bench/out/profile-llama-8b.json
    python scripts/profile_layout.py --shape llama-8b --mps 30,50,70 --out bench/out/profile-llama-8b.json
    python scripts/profile_layout.py --shape llama-8b --handoff --out bench/out/profile-llama-8b.json
    python scripts/profile_layout.py --smoke [--tp 2] --out /tmp/profile.json  # tiny shape on CPU (gloo): no timings
    pdserve-plan --profile bench/out/profile-llama-8b.json --workload long-input --slo ttft:1000,tpot:15

The engine is built as a worker builds it (dummy weights, the pool sized from free memory), prefill with the
prefill worker's step budget (--max-num-batched-tokens). A decode grid point whose sequences do not fit the pool
is extrapolated along the batch from the two largest batches that fit, and marked so.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from bench_decode import replay_ms
from bench_moe import TINY, stats, sync, write_model
from bench_tp import MULTICAST_OFF

from pdserve.core import parallel
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, kv_pool_shape
from pdserve.core.engine import Engine
from pdserve.core.parallel import ParallelConfig
from pdserve.core.rank_group import die_with_leader
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.scheduler import StepPlan
from pdserve.router.placement import Mps
from pdserve.router.plan.profile import PROFILE_VERSION, ROLES, Profile


@dataclass(frozen=True)
class Grid:
    """What to measure."""

    prompt_lens: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    budget: int
    """max_num_batched_tokens of the engine (the prefill worker's step budget)."""
    steps: int
    """Timed decode steps per grid point."""
    repeats: int
    """Timed prefills per length."""
    chunks: tuple[int, ...]
    """Chunk sizes (step budgets) of --chunks: one prompt of the whole context, a pass per chunk."""
    mps_decode: tuple[int, int]
    """The decode step (batch, context) --mps times under each SM share."""


GPU_GRID = Grid(
    (128, 512, 1024, 2048, 4096, 8192), (1, 16, 64, 128), (512, 2048, 8192), 4096, 20, 3, (512, 2048, 4096), (64, 2048)
)
SMOKE_GRID = Grid((16, 64, 128), (1, 4), (32, 128), 64, 3, 2, (64, 128), (4, 128))


class PassSpans:
    """The GPU span (ms) of each forward pass the engine runs, with the pass's plan."""

    def __init__(self, engine: Engine) -> None:
        self.cuda = engine.runner.device.type == "cuda"
        self.pending: list[tuple[Any, Any, StepPlan]] = []
        execute = engine.runner.execute

        def timed(plan: StepPlan, sampled_rows: Any = None) -> torch.Tensor:
            start: Any = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
            if self.cuda:
                start.record()
            logits = execute(plan, sampled_rows)
            end: Any = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
            if self.cuda:
                end.record()
            self.pending.append((start, end, plan))
            return logits

        engine.runner.execute = timed  # type: ignore[method-assign]

    def take(self) -> list[tuple[float, StepPlan]]:
        """(span ms, plan) of the passes since the last take (waiting for the last pass to end)."""
        if self.cuda and self.pending:
            self.pending[-1][1].synchronize()
        spans = [
            (start.elapsed_time(end) if self.cuda else (end - start) * 1e3, plan) for start, end, plan in self.pending
        ]
        self.pending.clear()
        return spans


def make_engine(folder: Path, device: str, grid: Grid, num_blocks: int | None, pc: ParallelConfig) -> Engine:
    dtype = "float32" if device == "cpu" else "bfloat16"
    model = ModelConfig.from_pretrained(folder, dtype=dtype, load_format="dummy")
    cache = CacheConfig(num_blocks=num_blocks, enable_prefix_caching=False)
    scheduler = SchedulerConfig(max_num_seqs=max(grid.batches), max_num_batched_tokens=grid.budget)
    return Engine(EngineConfig(model, cache, scheduler, device=device, parallel=pc))


def prompt(engine: Engine, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.config.model.vocab_size, (n,), generator=gen).tolist()  # type: ignore[no-any-return]


def prefill_ms(engine: Engine, n: int, repeats: int) -> dict[str, Any]:
    """Add one prompt of n tokens (max_tokens 1), step until its token is out: median time over repeats."""
    device, counter = engine.runner.device, itertools.count()
    one = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = [prompt(engine, n, seed) for seed in range(repeats + 1)]
    times = []
    for i, ids in enumerate(prompts):
        sync(device)
        start = time.perf_counter()
        engine.add_request(f"p{n}-{next(counter)}", ids, one)
        while not engine.step():
            pass
        sync(device)
        if i > 0:  # NOTE: the first call of a length compiles and allocates
            times.append((time.perf_counter() - start) * 1e3)
        engine.flush_commits()
    return {"tokens": n, "ms": round(statistics.median(times), 4), **stats("ttft", times)}


def output_budget(batch: int, context: int, steps: int, budget: int) -> int:
    """max_tokens of a decode point's requests: more than they generate. The first of a batch decode while the
    others prefill (a prompt per pass at least, budget tokens a pass), then 2 warm-up and `steps` timed steps."""
    return -(-batch * context // budget) + batch + steps + 8


def longest_context(max_model_len: int, grid: Grid) -> int:
    """The longest context whose requests, at the grid's largest batch, fit the model's context with their
    output budget."""
    batch = max(grid.batches)
    context = (max_model_len - batch - grid.steps - 9) * grid.budget // (grid.budget + batch)
    while context + output_budget(batch, context, grid.steps, grid.budget) > max_model_len:
        context -= 1
    return context


def decode_ms(engine: Engine, batch: int, context: int, steps: int) -> dict[str, Any]:
    """engine.step() times while `batch` sequences of `context` prompt tokens decode (after 2 warm-up steps);
    RuntimeError if any of them finished before the timed steps ended (the step would not be of `batch`)."""
    device = engine.runner.device
    budget = engine.config.scheduler.max_num_batched_tokens
    params = SamplingParams(temperature=0.0, max_tokens=output_budget(batch, context, steps, budget), ignore_eos=True)
    ids = [f"d{batch}-{context}-{k}" for k in range(batch)]
    for k, rid in enumerate(ids):
        engine.add_request(rid, prompt(engine, context, k), params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in engine.step())
    engine.step()
    engine.step()
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    if len(engine.scheduler.running) != batch:
        raise RuntimeError(
            f"{len(engine.scheduler.running)} of {batch} sequences of {context} tokens still decode after the timed "
            f"steps ({len(engine.scheduler.waiting)} waiting, {engine.pool.num_free_blocks} of "
            f"{engine.pool.num_blocks} blocks free)"
        )
    graph = (
        replay_ms(engine, batch)
        if engine.runner.graphs is not None and batch <= engine.runner.graphs.max_size
        else None
    )
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    engine.flush_commits()
    return {"batch": batch, "context": context, "ms": round(statistics.median(times), 4), "graph_replay_ms": graph}


def fits(capacity: int, batch: int, context: int, grid: Grid, block: int) -> bool:
    """Whether `batch` sequences of `context` prompt tokens and their whole output budget fit the pool's
    `capacity` tokens in whole blocks (else the scheduler preempts one and the point is not of `batch`)."""
    tokens = context + output_budget(batch, context, grid.steps, grid.budget)
    return batch * -(-tokens // block) * block <= capacity


def largest_fitting(capacity: int, batch: int, context: int, grid: Grid, block: int) -> int:
    while batch > 1 and not fits(capacity, batch, context, grid, block):
        batch -= 1
    return batch


def extrapolated(rows: dict[int, dict[str, Any]], batch: int, context: int) -> dict[str, Any]:
    """A point beyond the pool, along the line through the two largest measured batches of this context."""
    (b0, r0), (b1, r1) = sorted(rows.items())[-2:]
    ms = r1["ms"] + (r1["ms"] - r0["ms"]) * (batch - b1) / (b1 - b0)
    return {"batch": batch, "context": context, "ms": round(ms, 4), "extrapolated": True}


def decode_grid(engine: Engine, grid: Grid, capacity: int) -> list[dict[str, Any]]:
    points = []
    longest = longest_context(engine.config.model.max_model_len, grid)
    block = engine.config.cache.block_size
    for context in sorted({min(c, longest) for c in grid.contexts}):
        rows: dict[int, dict[str, Any]] = {}
        for batch in grid.batches:
            if fits(capacity, batch, context, grid, block) or len(rows) < 2:
                size = largest_fitting(capacity, batch, context, grid, block)
                rows[size] = decode_ms(engine, size, context, grid.steps)
                print(f"decode batch {size} context {context}: {rows[size]['ms']:.3f} ms", flush=True)
            point = rows.get(batch) or extrapolated(rows, batch, context)
            points.append(point | {"batch": batch})
    return points


def measure(engine: Engine, grid: Grid) -> dict[str, Any]:
    """The worker's costs as a profile holds them: prefill points, decode grid, KV tokens of its pool."""
    capacity = (engine.pool.num_blocks - 1) * engine.config.cache.block_size
    prefill = []
    longest = engine.config.model.max_model_len - 1  # NOTE: a prompt of the whole context leaves no token to generate
    for n in sorted({min(n, longest) for n in grid.prompt_lens}):
        prefill.append(prefill_ms(engine, n, grid.repeats))
        print(f"prefill {n} tokens: {prefill[-1]['ms']:.3f} ms", flush=True)
    decode = decode_grid(engine, grid, capacity)
    return {"prefill": {"budget": grid.budget, "points": prefill}, "decode": {"points": decode},
            "kv_capacity_tokens": capacity}  # fmt: skip


def chunk_points(engine: Engine, repeats: int) -> list[dict[str, Any]]:
    """One prompt of the whole context in passes of the engine's budget: each whole-budget pass's GPU span
    (PassSpans) by the prompt's tokens before it, median over repeats (after one untimed prompt); a piece one token
    short counts as whole."""
    spans, n = PassSpans(engine), engine.config.model.max_model_len - 1
    budget = engine.config.scheduler.max_num_batched_tokens
    one = SamplingParams(temperature=0.0, max_tokens=1)
    times: dict[tuple[int, int], list[float]] = {}
    for seed in range(repeats + 1):
        engine.add_request(f"chunks-{seed}", prompt(engine, n, 1000 + seed), one)
        while not engine.step():
            pass
        engine.flush_commits()
        prefix = 0
        for ms, plan in spans.take():
            tokens = sum(c.num_tokens for c in plan.chunks)
            if seed > 0 and tokens >= budget - 1:  # NOTE: the last piece is a token short (one is left to generate)
                times.setdefault((budget, prefix), []).append(ms)
            prefix += tokens
    return [{"tokens": c, "prefix": p, "ms": round(statistics.median(ms), 4)} for (c, p), ms in sorted(times.items())]


def measure_chunks(folder: Path, device: str, grid: Grid, num_blocks: int | None) -> dict[str, Any]:
    """The "chunks" section: chunk_points of an engine of each chunk size as its step budget."""
    points = []
    for chunk in grid.chunks:
        engine = make_engine(folder, device, dataclasses.replace(grid, budget=chunk), num_blocks, ParallelConfig())
        points += chunk_points(engine, grid.repeats)
        print(f"chunks of {chunk}: " + ", ".join(f"{p['prefix']}: {p['ms']:.2f} ms" for p in points if
                                                 p["tokens"] == chunk), flush=True)  # fmt: skip
        del engine
    return {"points": points}


def copy_ms(copy: Any, device: torch.device, repeats: int, calls: int = 10) -> float:
    """Median ms of one copy() (GPU time of back-to-back calls on CUDA, host time on CPU)."""
    times = []
    for r in range(-1, repeats):  # NOTE: round -1 warms up
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                copy()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / calls
        else:
            begin = time.perf_counter()
            for _ in range(calls):
                copy()
            ms = (time.perf_counter() - begin) * 1e3 / calls
        if r >= 0:
            times.append(ms)
    return statistics.median(times)


def measure_handoff(folder: Path, device: str, grid: Grid, fixed_ms: float) -> dict[str, Any]:
    """The "handoff" section: per prompt length, the copy of its KV blocks into the decode pool as a pull makes it
    (kernels/block_copy.py on the decode GPU reading the prefill pool over peer access; torch's reference on CPU);
    ms_per_token is the least-squares slope through them. fixed_ms (the handoff's messages) is kept as it was."""
    from pdserve.kernels.block_copy import copy_blocks, copy_blocks_ref
    from pdserve.kvtransfer.cuda_ipc import enable_peer_access

    cfg = ModelConfig.from_pretrained(str(folder), dtype="float32" if device == "cpu" else "bfloat16")
    cuda = device == "cuda"
    dst = torch.device("cuda:0" if cuda else "cpu")
    src = torch.device("cuda:1") if cuda and torch.cuda.device_count() > 1 else dst
    if src != dst and not enable_peer_access(dst, src):
        raise RuntimeError(f"{dst} cannot read {src}: no peer access")
    block = 16
    blocks = -(-max(grid.prompt_lens) // block) + 1  # NOTE: block 0 stays the null block
    shape = kv_pool_shape(cfg.num_layers, blocks, block, cfg.num_kv_heads, cfg.head_dim)
    pools = [torch.zeros(shape, dtype=cfg.torch_dtype, device=d) for d in (src, dst)]
    copy = copy_blocks if cuda else copy_blocks_ref
    points = []
    for tokens in grid.prompt_lens:
        ids = torch.arange(1, 1 + -(-tokens // block), device=dst)
        ms = copy_ms(lambda ids=ids: copy(pools[0], pools[1], ids, ids), dst, grid.repeats)
        points.append({"tokens": tokens, "ms": round(ms, 4)})
        print(f"handoff copy of {tokens} tokens: {ms:.3f} ms", flush=True)
    xs, ys = [p["tokens"] for p in points], [p["ms"] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)
    pair = f"{src} -> {dst}" if src != dst else f"within {dst}"
    return {"fixed_ms": fixed_ms, "ms_per_token": max(0.0, slope), "copy": pair, "points": points}


def role_steps(engine: Engine, grid: Grid, roles: tuple[str, ...] = ROLES) -> dict[str, float]:
    """A full-budget prefill (ms to its first token) and one grid.mps_decode decode step (ms) of this engine."""
    steps = {"prefill": lambda: prefill_ms(engine, grid.budget, grid.repeats)["ms"],
             "decode": lambda: decode_ms(engine, *grid.mps_decode, grid.steps)["ms"]}  # fmt: skip
    return {role: steps[role]() for role in roles}


def load(engine: Engine, role: str, grid: Grid, running: Path) -> None:
    """Run role's work until SIGTERM (another process measures beside it): full-budget prefills one after another,
    or grid.mps_decode's decode step over and over (its CUDA graph replayed, at most two replays queued; on CPU the
    batch decoding, prefilled again when it finishes); touch `running` once it runs. It stops between steps and
    leaves the GPU idle, so the next MPS client finds the server free."""
    die_with_leader()  # NOTE: never outlive measure_mps, whatever ends it
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    steps = prefill_load(engine, grid) if role == "prefill" else decode_load(engine, grid)
    for _ in itertools.takewhile(lambda _: not stop, steps):
        running.touch()
    sync(engine.runner.device)


def prefill_load(engine: Engine, grid: Grid) -> Iterator[None]:
    """Full-budget prefills of one token each, one after another: yields after each."""
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for k in itertools.count():
        engine.add_request(f"load-{k}", prompt(engine, grid.budget, k), one)
        while not engine.step():
            pass
        engine.flush_commits()
        yield


def decode_load(engine: Engine, grid: Grid) -> Iterator[None]:
    """grid.mps_decode's batch decoding: yields after each step once the whole batch runs (then its CUDA graph
    replayed, waiting for the replay before last, so at most two are queued when it stops)."""
    batch, context = grid.mps_decode
    budget = engine.config.scheduler.max_num_batched_tokens
    params = SamplingParams(temperature=0.0, max_tokens=output_budget(batch, context, 0, budget), ignore_eos=True)
    graphs = engine.runner.graphs
    for k in itertools.count():
        for i in range(batch):
            engine.add_request(f"load-{k}-{i}", prompt(engine, context, i), params)
        while engine.has_unfinished():
            engine.step()
            if len(engine.scheduler.running) == batch and not engine.scheduler.waiting:
                yield
                if graphs is not None and batch <= graphs.max_size:
                    yield from replays(graphs, batch)
        engine.flush_commits()


def replays(graphs: Any, batch: int) -> Iterator[None]:
    """The batch's captured step replayed forever, yielding after each; the replay before last is waited for."""
    done = [torch.cuda.Event(), torch.cuda.Event()]
    for k in itertools.count():
        graphs.replay(batch)
        done[k % 2].record()
        done[(k + 1) % 2].synchronize()  # NOTE: unrecorded at k = 0: returns at once
        yield


def mps_num_blocks(grid: Grid, block_size: int) -> int:
    """KV blocks of a --mps child: the decode point's batch with its output budget, and a full-budget prompt (two
    engines share the GPU, so neither sizes its pool from free memory)."""
    batch, context = grid.mps_decode
    tokens = context + output_budget(batch, context, grid.steps, grid.budget)
    return batch * -(-tokens // block_size) + -(-grid.budget // block_size) + 16


def wait_for(path: Path, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout_s:.0f} s")
        time.sleep(0.05)


def measure_mps(shares: list[int], args: argparse.Namespace, scratch: Path, grid: Grid) -> dict[str, Any]:
    """Each role's step time at each SM share over its time at 100%: one child process a share (--mps-child), each
    a client of a private MPS daemon (router/placement.py Mps) with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, alone on
    the GPU; then ("with_other") at each share while a second child runs the other role on the rest of the SMs.
    Without MPS (--smoke on CPU) the children run as they are and the factors say nothing."""
    mps = Mps(scratch / "mps", (100, 100))
    started = mps.start(dict(os.environ))
    if not started and not args.smoke:
        raise RuntimeError("--mps needs nvidia-cuda-mps-control")
    num_blocks = args.num_blocks or mps_num_blocks(grid, CacheConfig().block_size)
    child = MpsChildren(mps if started else None, args, scratch, num_blocks)
    try:
        alone = {share: child.measure(share, ROLES) for share in (100, *shares)}
        busy = {(role, s): child.measure(s, (role,), beside=100 - s)[role] for s in shares for role in ROLES}
    finally:
        if started:
            mps.stop(dict(os.environ))
    factors = {role: {str(s): round(alone[s][role] / alone[100][role], 4) for s in shares} for role in ROLES}
    with_other = {role: {str(s): round(busy[role, s] / alone[100][role], 4) for s in shares} for role in ROLES}
    return factors | {"with_other": with_other}


class MpsChildren:
    """profile_layout.py child processes, each an MPS client at an SM share (--mps-child, --mps-load)."""

    def __init__(self, mps: Mps | None, args: argparse.Namespace, scratch: Path, num_blocks: int) -> None:
        self.mps, self.args, self.scratch, self.num_blocks = mps, args, scratch, num_blocks

    def argv(self, *flags: str) -> list[str]:
        smoke = ["--smoke"] if self.args.smoke else []
        shape = ["--shape", self.args.shape, "--num-blocks", str(self.num_blocks), "--out", self.args.out]
        return [sys.executable, __file__, *flags, *smoke, *shape]

    def env(self, share: int) -> dict[str, str]:
        client = self.mps.worker_env("profile", "prefill", os.environ.get("CUDA_VISIBLE_DEVICES")) if self.mps else {}
        return os.environ | client | {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(share)}  # NOTE: GPUs by UUID

    def measure(self, share: int, roles: tuple[str, ...], beside: int | None = None) -> dict[str, float]:
        """roles' step times at `share`; with beside, while the other role's load runs at that share. A load that
        exits before it ran (an MPS client refused while the server still releases the last one) is started once
        more."""
        out = self.scratch / f"mps-{share}-{'-'.join(roles)}-{beside}.json"
        for attempt in (1, 2):
            try:
                self.run_pair(share, roles, beside, out)
                break
            except LoadFailed as exc:
                if exc.ran or attempt == 2:
                    raise
                print(f"profile_layout.py: {exc}; starting it again", file=sys.stderr, flush=True)
                time.sleep(5.0)
        times: dict[str, float] = json.loads(out.read_text())
        print(f"MPS share {share}%{f' beside {beside}%' if beside else ''}: {times}", flush=True)
        return times

    def run_pair(self, share: int, roles: tuple[str, ...], beside: int | None, out: Path) -> None:
        """The measuring child (and with beside, the load beside it) until the measurement is written."""
        flags = ["--mps-child", str(out), "--mps-roles", ",".join(roles)]
        loader, running = None, self.scratch / f"running-{share}-{roles[0]}"
        if beside is not None:
            running.unlink(missing_ok=True)
            other = next(r for r in ROLES if r not in roles)
            loader = subprocess.Popen(
                self.argv("--mps-load", other, "--mps-running", str(running)), env=self.env(beside)
            )
            flags += ["--mps-after", str(running)]
        measuring = subprocess.Popen(self.argv(*flags), env=self.env(share))
        try:
            while measuring.poll() is None and (loader is None or loader.poll() is None):
                time.sleep(0.1)
            if loader is not None and loader.poll() is not None:  # NOTE: a measurement without its load is void
                failed = f"the {other} load beside the measurement exited ({loader.returncode})"
                raise LoadFailed(failed, running.exists())
            if measuring.returncode:
                raise subprocess.CalledProcessError(measuring.returncode, measuring.args)
        finally:
            stop(measuring)
            if loader is not None:
                stop(loader)


class LoadFailed(RuntimeError):
    """The load beside a measurement exited; `ran`: after it had started running."""

    def __init__(self, message: str, ran: bool) -> None:
        super().__init__(message)
        self.ran = ran


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """SIGTERM (a load stops between steps and drains its queue), SIGKILL past timeout_s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rank_main(rank: int, size: int, folder: str, device: str, grid: Grid, num_blocks: int | None, out: str) -> None:
    """Rank `rank` of a worker of `size` ranks: every rank runs the same steps (their control flow depends on counts
    alone, the pool's size agreed by the group); rank 0 reports and writes the costs to out."""
    rank_device = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    pc = ParallelConfig(size, rank)
    parallel.init_tp_group(pc, f"file://{out}.rendezvous", rank_device)
    engine = make_engine(Path(folder), str(rank_device), grid, num_blocks, pc)
    with contextlib.nullcontext() if rank == 0 else contextlib.redirect_stdout(io.StringIO()):
        costs = measure(engine, grid)
    parallel.close_tp_group()
    if rank == 0:
        Path(out).write_text(json.dumps(costs))


def measure_tp(size: int, folder: Path, device: str, grid: Grid, num_blocks: int | None) -> dict[str, Any]:
    """The costs of a worker of `size` ranks, one process each."""
    out = folder / f"costs-tp{size}.json"
    mp.spawn(rank_main, args=(size, str(folder), device, grid, num_blocks, str(out)), nprocs=size, join=True)
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def tp1_profile(out: Path, args: argparse.Namespace, gpu: str) -> dict[str, Any]:
    """The TP-1 profile at out that --tp / --chunks / --mps adds to; ValueError when there is none of this shape and
    GPU."""
    adding = added_section(args)
    flag = adding[1] if adding else f"--tp {args.tp}"
    if not out.exists():
        raise ValueError(f"{flag} adds to the TP-1 profile at --out: profile TP 1 into {out} first")
    doc: dict[str, Any] = json.loads(out.read_text())
    Profile.from_json(doc)
    model = doc.get("model", {})
    if (model.get("shape"), model.get("smoke"), doc.get("gpu")) != (args.shape, args.smoke, gpu):
        raise ValueError(
            f"{out} profiles {model.get('shape')} (smoke {model.get('smoke')}) on {doc.get('gpu')}, not {args.shape} "
            f"(smoke {args.smoke}) on {gpu}"
        )
    return doc


def mps_child(args: argparse.Namespace, engine: Engine, grid: Grid) -> int:
    """A child of measure_mps: the load beside a measurement (--mps-load, until killed), or the measurement."""
    if args.mps_load:
        load(engine, args.mps_load, grid, Path(args.mps_running))
        return 0
    roles = tuple(args.mps_roles.split(","))
    if args.mps_after:
        role_steps(engine, grid, roles)  # NOTE: compiles and allocates before the load runs beside it
        wait_for(Path(args.mps_after))
    Path(args.mps_child).write_text(json.dumps(role_steps(engine, grid, roles)))
    return 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-8b", help="a make_bench_model.py shape")
    p.add_argument("--gpus", type=int, default=2, help="GPUs the planner lays out by default")
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU, float32: runs end to end")
    p.add_argument("--tp", type=int, default=1, help="TP size of the worker profiled; > 1 adds it to --out's profile")
    p.add_argument("--chunks", action="store_true", help="add the chunk-at-prefix costs to --out's TP-1 profile")
    p.add_argument("--mps", default=None, metavar="SHARES", help="e.g. 30,50,70: add each role's slowdown at these SM "
                   "shares (percent) to --out's TP-1 profile")  # fmt: skip
    p.add_argument("--handoff", action="store_true", help="add the handoff's KV copy per prompt token to --out's "
                   "TP-1 profile (GPU 1 -> GPU 0 where two are visible)")  # fmt: skip
    p.add_argument("--mps-child", default=None, help=argparse.SUPPRESS)  # NOTE: one share's run (measure_mps)
    p.add_argument("--mps-roles", default=",".join(ROLES), help=argparse.SUPPRESS)  # NOTE: what --mps-child times
    p.add_argument("--mps-after", default=None, help=argparse.SUPPRESS)  # NOTE: --mps-child waits for this file
    p.add_argument("--mps-load", default=None, choices=ROLES, help=argparse.SUPPRESS)  # NOTE: a load until killed
    p.add_argument("--mps-running", default=None, help=argparse.SUPPRESS)  # NOTE: --mps-load touches it
    p.add_argument("--max-model-len", type=int, default=None, help="recorded for the planner (default: the shape's)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool blocks (default: sized from free memory)")
    p.add_argument("--out", required=True, help="write the profile here (--tp > 1: the TP-1 profile to add to)")
    return p.parse_args()


def added_section(args: argparse.Namespace) -> tuple[str, str] | None:
    """(section, flag) a call adds to the TP-1 profile at --out (--chunks, --mps, --handoff); None otherwise."""
    if args.chunks:
        return "chunks", "--chunks"
    if args.handoff:
        return "handoff", "--handoff"
    return ("mps_slowdown", "--mps") if args.mps else None


def mps_shares(spec: str) -> list[int]:
    """'30,50' -> [30, 50]; ValueError outside 1..99."""
    shares = [int(s) for s in spec.split(",") if s.strip()]
    if not shares or not all(1 <= s <= 99 for s in shares):
        raise ValueError(f"--mps {spec}: SM shares in percent, each 1 to 99")
    return shares


def main() -> int:
    args = parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and torch.cuda.device_count() < args.tp:
        print(f"needs {args.tp} CUDA device(s) (--smoke runs on CPU)", file=sys.stderr)
        return 2
    gpu, out = torch.cuda.get_device_name() if device == "cuda" else "cpu", Path(args.out)
    adding = added_section(args)
    try:
        if adding and args.tp > 1:
            raise ValueError(f"{adding[1]} measures TP 1 (the planner applies it to a TP worker): drop --tp")
        shares = mps_shares(args.mps) if args.mps else []
        child = args.mps_child or args.mps_load
        base = tp1_profile(out, args, gpu) if (args.tp > 1 or adding) and not child else None
    except ValueError as exc:
        print(f"profile_layout.py: {exc}", file=sys.stderr)
        return 2
    os.environ.update(MULTICAST_OFF)  # NOTE: before any rank (or CUDA context) exists
    grid = SMOKE_GRID if args.smoke else GPU_GRID
    scratch = Path(tempfile.mkdtemp(prefix="profile_layout_"))
    folder = write_model(args.shape, scratch, dict(TINY) if args.smoke else {})
    num_blocks = args.num_blocks or (256 if args.smoke else None)
    if args.mps_child or args.mps_load:
        return mps_child(args, make_engine(folder, device, grid, num_blocks, ParallelConfig()), grid)
    if args.chunks:
        costs = measure_chunks(folder, device, grid, num_blocks)
    elif args.mps:
        costs = measure_mps(shares, args, scratch, grid)
    elif args.handoff:
        assert base is not None
        costs = measure_handoff(folder, device, grid, float(base.get("handoff", {}).get("fixed_ms", 1.0)))
    elif args.tp > 1:
        costs = measure_tp(args.tp, folder, device, grid, num_blocks)
    else:
        costs = measure(make_engine(folder, device, grid, num_blocks, ParallelConfig()), grid)
    command = shlex.join([sys.executable, *sys.argv])
    if base is not None and adding:
        doc = base | {adding[0]: costs | {"command": command}}
    elif base is not None:
        doc = base | {"tp": base.get("tp", {}) | {str(args.tp): costs | {"command": command}}}
    else:
        config = json.loads((folder / "config.json").read_text())
        doc = {
            "version": PROFILE_VERSION, "gpu": gpu, "num_gpus": args.gpus, "command": command,
            "torch": torch.__version__,
            "model": {"shape": args.shape, "dtype": "float32" if args.smoke else "bfloat16", "smoke": args.smoke,
                      "num_hidden_layers": config.get("num_hidden_layers"),
                      "max_model_len": args.max_model_len or config.get("max_position_embeddings")},
        } | costs  # fmt: skip
    Profile.from_json(doc).at_tp(args.tp)  # NOTE: the planner must read what was written
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    section = f" ({adding[0]} section)" if adding else f" (TP {args.tp} section)" if base is not None else ""
    print(f"wrote {out}{section}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
