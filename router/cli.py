"""The router process's command line (`python -m pdserve.router`): its flags, their checks, the RouterConfig.

NOTE: no gRPC server or torch behind this module: the cluster launcher (router/cluster_cli.py) builds the
router's argv against this parser and checks it before anything starts.
"""

from __future__ import annotations

import argparse

from pdserve.core.cli import LOG_LEVELS
from pdserve.router.auth import API_KEY_ENV, EdgeSecurity, SecurityError, exposure_error, read_api_keys
from pdserve.router.config import RouterConfig

MAX_FRONTENDS = 64
"""Most router processes of one cluster (a topology gives the router inboxes ports base_port + 0..99)."""


def add_router_args(p: argparse.ArgumentParser) -> None:
    """Every flag of the router."""
    p.add_argument("--model", required=True, help="model folder (config.json, tokenizer.json, chat template)")
    p.add_argument("--run-dir", required=True, help="the cluster's run directory (ipc sockets)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    p.add_argument("--bind", default="127.0.0.1", help="gRPC and HTTP host to listen on")
    p.add_argument(
        "--http-port", type=int, default=None,
        help="OpenAI-compatible HTTP port (default: --port + 1, or a free one with --port 0; -1: no HTTP)",
    )  # fmt: skip
    p.add_argument("--prefill", type=int, default=1, help="number of prefill workers (0: colocated decode workers)")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds of silence before a worker is down")
    p.add_argument("--block-size", type=int, default=None, help="the workers' KV block size (for GetModelInfo)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds streams get to finish on SIGTERM")
    p.add_argument("--routing", choices=["prefix", "round_robin"], default="prefix", help="prefill worker choice")
    p.add_argument("--max-queue-skew", type=int, default=8, help="queued requests that make a prefill worker hot")
    p.add_argument(
        "--conditional-disagg",
        action="store_true",
        help="a decode worker that holds all but a short tail of a prompt computes the tail itself",
    )
    p.add_argument("--local-prefill-threshold", type=int, default=64, help="longest such tail, tokens")
    p.add_argument(
        "--max-migrations", type=int, default=2, help="times a request of a lost worker moves to others (0: fail it)"
    )
    p.add_argument(
        "--max-queued", type=int, default=1024, help="requests that may wait for KV room (more: RESOURCE_EXHAUSTED)"
    )
    p.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus metrics on 127.0.0.1:PORT (0: any free port)"
    )
    p.add_argument(
        "--busy-poll-ms", type=float, default=0.0, help="after request activity, poll without sleeping this long"
    )
    # NOTE: internal (set by pdserve-cluster --frontends): this router's index among the router processes that
    # share the ports (SO_REUSEPORT) and the load counts (router/load_table.py), and their number
    p.add_argument("--frontend", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--num-frontends", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    add_security_args(p)


def add_security_args(p: argparse.ArgumentParser) -> None:
    """TLS and API keys of the gRPC port (router/auth.py)."""
    p.add_argument("--tls-cert", default=None, help="PEM server certificate: serve TLS only (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, help="PEM CA: require client certificates it signed")
    p.add_argument(
        "--api-key-file", default=None, help=f"accepted bearer keys, one a line (also ${API_KEY_ENV}): calls need one"
    )
    p.add_argument("--insecure", action="store_true", help="allow --bind beyond loopback with no client authentication")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.router", description="pdserve router: gRPC front end of the cluster"
    )
    add_router_args(p)
    return p


def router_args_error(args: argparse.Namespace) -> str | None:
    """What is wrong with parsed router flags beyond what argparse checks, or None."""
    if args.prefill < 0 or args.decode < 1:
        return "--prefill must be >= 0 and --decode >= 1"
    if args.heartbeat_timeout <= 0:
        return "--heartbeat-timeout must be > 0"
    if args.max_migrations < 0 or args.max_queued < 0:
        return "--max-migrations and --max-queued must be >= 0"
    if args.max_queue_skew < 1 or args.local_prefill_threshold < 1:
        return "--max-queue-skew and --local-prefill-threshold must be >= 1"
    if not 0 <= args.frontend < args.num_frontends or args.num_frontends > MAX_FRONTENDS:
        return f"--frontend must be in [0, --num-frontends) and --num-frontends in [1, {MAX_FRONTENDS}]"
    if args.num_frontends > 1 and (args.port == 0 or http_port(args.port, args.http_port) == 0):
        return "--num-frontends > 1 shares fixed ports: --port and --http-port must not be 0"
    try:
        return exposure_error(args.bind, security_from_args(args))
    except SecurityError as exc:
        return str(exc)


def security_from_args(args: argparse.Namespace) -> EdgeSecurity:
    """The edge security of the flags (API keys read from --api-key-file and the environment); SecurityError."""
    return EdgeSecurity(args.tls_cert, args.tls_key, args.tls_client_ca, read_api_keys(args.api_key_file),
                        args.insecure)  # fmt: skip


def config_from_args(args: argparse.Namespace) -> RouterConfig:
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
        routing=args.routing,
        max_queue_skew=args.max_queue_skew,
        conditional_disagg=args.conditional_disagg,
        local_prefill_threshold=args.local_prefill_threshold,
        max_migrations=args.max_migrations,
        max_queued=args.max_queued,
        metrics_port=args.metrics_port,
        busy_poll_s=max(args.busy_poll_ms, 0.0) / 1e3,
        security=security_from_args(args),
        http_port=http_port(args.port, args.http_port),
        frontend=args.frontend,
        num_frontends=args.num_frontends,
    )


def http_port(grpc_port: int, flag: int | None) -> int | None:
    """The HTTP port of --http-port: as given; unset, the gRPC port + 1 (0, any free port, for --port 0); None
    for a negative one (no HTTP)."""
    if flag is None:
        return grpc_port + 1 if grpc_port else 0
    return None if flag < 0 else flag
