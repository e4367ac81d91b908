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
from pdserve.core.worker_base import WorkerBase

WorkerFactory = Callable[[EngineConfig, argparse.Namespace], WorkerBase]


def main(role: str, factory: WorkerFactory, argv: list[str] | None = None) -> int:
    imports_s = process_age_s()  # NOTE: the interpreter's start and every import of the worker's module
    parser = argparse.ArgumentParser(prog=f"python -m pdserve.{role}_worker", description=f"pdserve {role} worker")
    add_worker_args(parser)
    args = parser.parse_args(argv)
    if (error := worker_args_error(args)) is not None:
        parser.error(error)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s {role}-{args.worker_id} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    try:
        cfg = engine_config_from_args(args)
        worker = factory(cfg, args)
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
        device=args.device,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
    )
