"""The worker processes' command line (`python -m pdserve.prefill_worker` / `decode_worker`): flags and checks.

No torch here (core/worker_main.py maps the flags onto EngineConfig): the cluster launcher, in the
torch-free router package, builds each worker's argv against this parser.
"""

from __future__ import annotations

import argparse

from pdserve.core.busy_poll import CUDA_BUSY_POLL_S


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model folder (config.json + safetensors)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from memory)")
    parser.add_argument("--kv-memory-fraction", type=float, default=0.5)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--prefill-chunk-size", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--enforce-eager", action="store_true", help="run every pass eagerly: no CUDA graphs at all")
    parser.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel processes of this worker (rank 0 starts the others); with --device cuda[:K] rank r "
        "runs on cuda:K+r",
    )
    parser.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)  # set by rank 0 only
    parser.add_argument("--tp-group", default=None, help=argparse.SUPPRESS)  # rank 0's group files (rank_group.py)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker-id", type=int, required=True)
    parser.add_argument("--run-dir", required=True, help="folder of the cluster's ipc sockets")
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--num-decode", type=int, default=1)
    # internal (pdserve-cluster --frontends): the router processes to send requests' events to
    parser.add_argument("--num-frontends", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "shm", "cuda_ipc", "dist"],
        help="auto: per prefill/decode pair, cuda_ipc (CUDA) or shm (CPU) within a host, dist across hosts",
    )
    parser.add_argument("--heartbeat-interval", type=float, default=0.25)
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=0,
        help="torch's CPU threads in this process (0: torch's default, one per core; pdserve-cluster gives each "
        "worker its share of the cores)",
    )
    parser.add_argument(
        "--busy-poll-ms",
        type=float,
        default=None,
        help="after work, poll without sleeping this long before blocking (default: "
        f"{CUDA_BUSY_POLL_S * 1e3:g} on CUDA, 0 on CPU)",
    )
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="WARNING drops the per-request lines"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus metrics on 127.0.0.1:PORT (0: any free port)"
    )


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of a prefill or decode worker."""
    add_engine_args(parser)
    add_cluster_args(parser)


def worker_args_error(args: argparse.Namespace) -> str | None:
    """What is wrong with parsed worker flags beyond what argparse checks, or None."""
    if args.block_size < 1 or (args.num_blocks is not None and args.num_blocks < 2):
        return "--block-size must be >= 1 and --num-blocks >= 2"
    if args.cpu_threads < 0:
        return "--cpu-threads must be >= 0"
    if args.num_frontends < 1:
        return "--num-frontends must be >= 1"
    if args.tp_size < 1 or not 0 <= args.tp_rank < args.tp_size:
        return f"--tp-size must be >= 1 (got {args.tp_size}; rank {args.tp_rank})"
    if args.tp_rank > 0 and args.tp_group is None:
        return "--tp-rank is set by rank 0 of a TP group, with --tp-group"
    return None
