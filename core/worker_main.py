"""Entry point shared by `python -m pdserve.prefill_worker` and `python -m pdserve.decode_worker`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from pdserve.core.busy_poll import busy_poll_seconds
from pdserve.core.cli import add_cluster_args, add_engine_args, engine_config_from_args
from pdserve.core.config import EngineConfig
from pdserve.core.worker_base import WorkerBase

WorkerFactory = Callable[[EngineConfig, argparse.Namespace], WorkerBase]


def main(role: str, factory: WorkerFactory, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m pdserve.{role}_worker", description=f"pdserve {role} worker")
    add_engine_args(parser)
    add_cluster_args(parser)
    args = parser.parse_args(argv)
    if args.block_size < 1 or (args.num_blocks is not None and args.num_blocks < 2):
        parser.error("--block-size must be >= 1 and --num-blocks >= 2")
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s {role}-{args.worker_id} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = engine_config_from_args(args)
        worker = factory(cfg, args)
        worker.busy_poll_s = busy_poll_seconds(args.busy_poll_ms, cfg.device)
        if args.metrics_port is not None:
            port_file = Path(args.run_dir) / "metrics" / f"{role}-{args.worker_id}.port"
            port = worker.metrics.serve(args.metrics_port, port_file)
            logging.getLogger(__name__).info("metrics on http://127.0.0.1:%d/metrics", port)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"pdserve {role} worker {args.worker_id}: cannot start: {exc}", file=sys.stderr)
        return 2
    worker.run()
    return 0
