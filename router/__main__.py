"""`python -m router`: the router process (see router/server.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from router.config import RouterConfig
from router.server import StartupError, serve


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    p = argparse.ArgumentParser(prog="python -m router", description="pdserve router: gRPC front end of the cluster")
    p.add_argument("--model", required=True, help="model folder (config.json, tokenizer.json, chat template)")
    p.add_argument("--run-dir", required=True, help="the cluster's run directory (ipc sockets)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    p.add_argument("--bind", default="127.0.0.1", help="gRPC host to listen on")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill workers (0: colocated decode workers)")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds of silence before a worker is down")
    p.add_argument("--block-size", type=int, default=None, help="the workers' KV block size (for GetModelInfo)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds streams get to finish on SIGTERM")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.prefill < 0 or args.decode < 1:
        p.error("--prefill must be >= 0 and --decode >= 1")
    if args.heartbeat_timeout <= 0:
        p.error("--heartbeat-timeout must be > 0")
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s router %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return RouterConfig(
        model_dir=args.model,
        run_dir=args.run_dir,
        num_prefill=args.prefill,
        num_decode=args.decode,
        port=args.port,
        bind=args.bind,
        heartbeat_timeout=args.heartbeat_timeout,
        block_size=args.block_size,
        grace_s=args.grace,
    )


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        asyncio.run(serve(cfg))
    except StartupError as exc:
        print(f"pdserve router: cannot start: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
