"""Entry point shared by `python -m pdserve.prefill_worker` and `python -m pdserve.decode_worker`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.core.busy_poll import busy_poll_seconds
from pdserve.core.cli import add_worker_args, worker_args_error
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.lifecycle import STARTUP_ERROR_EXIT, process_age_s
from pdserve.core.parallel import ParallelConfig, init_tp_group
from pdserve.core.rank_follower import RankFollower
from pdserve.core.rank_group import RankGroup, die_with_leader, group_paths
from pdserve.core.worker_base import WorkerBase

WorkerFactory = Callable[[EngineConfig, argparse.Namespace, RankGroup | None], WorkerBase]
RankFactory = Callable[[EngineConfig, argparse.Namespace], RankFollower]


def main(role: str, factory: WorkerFactory, rank_factory: RankFactory, argv: list[str] | None = None) -> int:
    """A worker process: rank 0 of its TP group (the worker itself, which starts the other ranks), or a rank > 0
    (started by rank 0 with --tp-rank and --tp-group)."""
    imports_s = process_age_s()  # NOTE: the interpreter's start and every import of the worker's module
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=f"python -m pdserve.{role}_worker", description=f"pdserve {role} worker")
    add_worker_args(parser)
    args = parser.parse_args(argv)
    if (error := worker_args_error(args)) is not None:
        parser.error(error)
    if args.tp_rank > 0:
        die_with_leader()
    name = f"{role}-{args.worker_id}" + (f".r{args.tp_rank}" if args.tp_rank else "")
    logging.basicConfig(
        level=args.log_level, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    if args.tp_rank > 0:
        return _follow(role, rank_factory, args)
    try:
        cfg = engine_config_from_args(args)
        group = _start_group(role, args, argv, cfg)
        worker = factory(cfg, args, group)
        worker.startup_s = {"imports": imports_s or 0.0, **worker.engine.runner.startup_s}
        worker.busy_poll_s = busy_poll_seconds(args.busy_poll_ms, cfg.device)
        if args.metrics_port is not None:
            port_file = Path(args.run_dir) / "metrics" / f"{role}-{args.worker_id}.port"
            port = worker.metrics.serve(args.metrics_port, port_file)
            logging.getLogger(__name__).info("metrics on http://127.0.0.1:%d/metrics", port)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"pdserve {role} worker {args.worker_id}: cannot start: {exc}", file=sys.stderr)
        return STARTUP_ERROR_EXIT
    worker.run()
    return 0


def _start_group(role: str, args: argparse.Namespace, argv: list[str], cfg: EngineConfig) -> RankGroup | None:
    """Rank 0 of a TP group: start the other ranks and join the group with them (None at TP size 1)."""
    if args.tp_size == 1:
        return None
    import zmq

    group = RankGroup(zmq.Context.instance(), args.run_dir, f"{role}-{args.worker_id}", args.tp_size,
                      ["-m", f"pdserve.{role}_worker", *argv])  # fmt: skip
    init_tp_group(cfg.parallel, group.init_method, torch.device(cfg.device))
    return group


def _follow(role: str, rank_factory: RankFactory, args: argparse.Namespace) -> int:
    """A rank > 0: join the group, build its shard, serve rank 0."""
    try:
        cfg = engine_config_from_args(args)
        init_tp_group(cfg.parallel, group_paths(args.tp_group)[0], torch.device(cfg.device))
        follower = rank_factory(cfg, args)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"pdserve {role} worker {args.worker_id} TP rank {args.tp_rank}: cannot start: {exc}", file=sys.stderr)
        return STARTUP_ERROR_EXIT
    return follower.run()


def rank_device(device: str, tp_size: int, tp_rank: int) -> str:
    """The device of a TP rank: cuda[:K] -> cuda:K+rank (cpu, and any device at TP size 1, as given)."""
    if tp_size == 1 or not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + tp_rank}"


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    model = ModelConfig.from_pretrained(args.model, dtype=args.dtype, load_format=args.load_format)
    cache = CacheConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        memory_fraction=args.kv_memory_fraction,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
    )
    return EngineConfig(
        model=model,
        cache=cache,
        scheduler=sched,
        device=rank_device(args.device, args.tp_size, args.tp_rank),
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        parallel=ParallelConfig(args.tp_size, args.tp_rank),
    )
