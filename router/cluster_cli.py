"""`pdserve-cluster` (scripts/launch_cluster.sh): a router, N prefill and M decode workers under supervision
(router/supervisor.py); with --colocated, the router and M decode workers that prefill their own requests; with
--frontends K, K router processes (router-0..K-1) on the same ports instead of one.

The launcher's own flags are the cluster-level ones below; it hands model, run dir, log level, busy-poll window
and block size to every process and sets each one's plumbing (--worker-id, --num-prefill, ports, its role's
--tp-size). Any other flag goes to the processes whose own parser defines it (router/cluster_flags.py), and
every process's final command line is checked with its parser before the first one starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

from pdserve.core.busy_poll import CUDA_BUSY_POLL_S, busy_poll_seconds
from pdserve.core.curve import KEYS_FILE, ClusterKeys
from pdserve.core.ipc import TOPOLOGY_FILE
from pdserve.router.cli import LOG_LEVELS, MAX_FRONTENDS
from pdserve.router.cluster_flags import CHILD_CLIS, ROUTER, WORKER, ArgvError, ChildCli, split_flags
from pdserve.router.load_table import remove_tables
from pdserve.router.placement import (
    Mps,
    alone_on_their_gpus,
    compute_gpus,
    gpu_lists,
    placement,
    read_topology,
    roles_share_a_gpu,
    within_visible,
)
from pdserve.router.status import RUN_DIR_PREFIX
from pdserve.router.supervisor import Child, Supervisor

CHILD_PREFIX = 3
"""Tokens before a child's flags in its argv: python -m MODULE."""


class ClusterPlan(NamedTuple):
    """The processes a command line asks for, their command lines checked, none started."""

    children: list[Child]
    grace: float
    """The router's --grace, as its parser reads it: how long the router may take to stop."""


def build_parser() -> argparse.ArgumentParser:
    # no abbreviations: "--max-q" must not become a launcher flag instead of reaching the router
    p = argparse.ArgumentParser(
        prog="pdserve-cluster",
        description="Run a pdserve cluster under supervision.",
        allow_abbrev=False,
        epilog=f"Any other flag goes to each process whose own parser defines it: see `{ROUTER.prog} --help` "
        "(e.g. --grace, --routing, --max-queued) and `python -m pdserve.prefill_worker --help` "
        "(e.g. --num-blocks, --dtype, --transport).",
    )
    p.add_argument("--model", required=True, help="model folder, for every process")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--device", default="cpu", help="the workers' device: cpu | cuda | cuda:N")
    p.add_argument("--port", type=int, default=50051, help="the router's gRPC port (0: a free one)")
    p.add_argument("--bind", default="127.0.0.1", help="the router's gRPC host")
    p.add_argument(
        "--frontends", type=int, default=1,
        help="router processes (router-0..K-1) sharing the gRPC and HTTP ports (SO_REUSEPORT), each serving the "
        "streams of its own connections; their metrics ports follow the workers' (default 1: one router)",
    )  # fmt: skip
    p.add_argument("--run-dir", default=None, help="ipc sockets, logs, stats (default: a new temp dir)")
    p.add_argument(
        "--colocated",
        action="store_true",
        help="no prefill workers: each decode worker prefills its own requests (the benchmarks' baseline)",
    )
    p.add_argument("--block-size", type=int, default=16, help="KV block size (tokens) of every worker")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9400,
        help="Prometheus metrics on 127.0.0.1: router at this port, prefill i at +1+i, decode j at +1+P+j "
        "(0: free ports, written to RUN_DIR/metrics/; -1: off)",
    )
    p.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="every process; WARNING drops "
        "the per-request lines",
    )  # fmt: skip
    p.add_argument(
        "--busy-poll-ms",
        type=float,
        default=None,
        help=f"every process: after work, poll without sleeping this long (default: {CUDA_BUSY_POLL_S * 1e3:g} on "
        "CUDA, 0 on CPU)",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch's CPU threads per process (default: this host's cores / the TP ranks of the workers started "
        "here, at least 1)",
    )
    _add_placement_args(p)
    return p


def _add_placement_args(p: argparse.ArgumentParser) -> None:
    """Where the processes run: MPS, GPUs, hosts."""
    p.add_argument(
        "--mps",
        choices=["auto", "on", "off"],
        default="auto",
        help="MPS SM partitioning between roles sharing a GPU (auto: on for --device cuda)",
    )
    p.add_argument("--mps-split", default="50/50", help="SM share in percent, prefill/decode (default 50/50)")
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel ranks (processes, one GPU each on CUDA) of each worker of a role without its own "
        "flag below (default 1); with --colocated, the decode workers'",
    )
    p.add_argument("--prefill-tp", type=int, default=None, help="TP ranks of each prefill worker (default --tp)")
    p.add_argument("--decode-tp", type=int, default=None, help="TP ranks of each decode worker (default --tp)")
    p.add_argument(
        "--prefill-gpus",
        default=None,
        help="GPUs of the prefill workers, e.g. 0 or 0,1 (indices within CUDA_VISIBLE_DEVICES when set, or UUIDs): "
        "cut into groups of --prefill-tp, one group per worker (round robin)",
    )
    p.add_argument(
        "--decode-gpus",
        default=None,
        help="GPUs of the decode workers, in groups of --decode-tp; MPS (auto) only where roles share a GPU",
    )
    p.add_argument(
        "--topology",
        default=None,
        help="JSON {router: host, prefill: [hosts], decode: [hosts], base_port}: a cluster over several hosts, "
        "TCP between its processes, authenticated with CURVE (docs/deployment.md)",
    )
    p.add_argument(
        "--cluster-keys",
        default=None,
        help="with --topology: the cluster's CURVE keys, a file to copy to every host with the topology (default: "
        "the topology's path with suffix .keys; the launcher that starts the router makes it when missing)",
    )
    p.add_argument("--roles", default=None, help="start only these processes here, e.g. router or prefill-0,decode-0")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's own flags, and what is left for the children; exits 2 on a bad launcher flag."""
    args, rest = parser.parse_known_args(argv)
    _check_args(parser, args)
    return args, rest


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Cross-flag checks and derived values (topology, colocated, roles)."""
    if args.colocated:
        args.prefill = 0
    elif args.prefill < 1:
        p.error("--prefill must be >= 1 (or use --colocated)")
    if args.decode < 1:
        p.error("--decode must be >= 1")
    if not 1 <= args.frontends <= MAX_FRONTENDS or (args.frontends > 1 and args.port == 0):
        p.error(f"--frontends must be in [1, {MAX_FRONTENDS}], and more than 1 need a fixed --port (not 0)")
    try:
        args.topology_hosts = read_topology(Path(args.topology), args.prefill, args.decode) if args.topology else None
        args.prefill_tp, args.decode_tp = _tp_sizes(args)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        prefill_gpus = within_visible(gpu_lists(args.prefill_gpus), visible, "--prefill-gpus")
        decode_gpus = within_visible(gpu_lists(args.decode_gpus), visible, "--decode-gpus")
        layout = (prefill_gpus, decode_gpus, args.prefill, args.decode, args.prefill_tp, args.decode_tp)
        args.gpus = placement(*layout)
        args.whole_gpu = frozenset(alone_on_their_gpus(compute_gpus(*layout)))
        args.mps_shares = _mps_shares(args.mps_split)
    except ValueError as exc:
        p.error(str(exc))
    routers = router_names(args.frontends)
    names = {*routers, *(f"prefill-{i}" for i in range(args.prefill)), *(f"decode-{j}" for j in range(args.decode))}
    wanted = {r.strip() for r in args.roles.split(",") if r.strip()} if args.roles else names
    if unknown := wanted - names - {"router"}:
        p.error(f"--roles: unknown roles {sorted(unknown)}")
    args.wanted = (wanted - {"router"}) | set(routers) if "router" in wanted else wanted  # router: every one


def router_names(num_frontends: int) -> list[str]:
    """The router processes' names: router, or router-0..K-1 for K front ends."""
    return ["router"] if num_frontends == 1 else [f"router-{k}" for k in range(num_frontends)]


def _tp_sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(prefill, decode) TP sizes: each role's own flag, else --tp, else 1; ValueError naming the flag."""
    if args.colocated and args.prefill_tp is not None:
        raise ValueError("--prefill-tp: --colocated has no prefill workers (--tp / --decode-tp size the others)")
    default = 1 if args.tp is None else args.tp
    prefill = default if args.prefill_tp is None else args.prefill_tp
    decode = default if args.decode_tp is None else args.decode_tp
    for flag, size in (("--tp", default), ("--prefill-tp", prefill), ("--decode-tp", decode)):
        if size < 1:
            raise ValueError(f"{flag} must be >= 1 (got {size})")
    return prefill, decode


def _mps_shares(split: str) -> tuple[int, int]:
    try:
        prefill, decode = (int(x) for x in split.split("/"))
    except ValueError:
        raise ValueError(f"--mps-split {split!r}: expected PREFILL/DECODE percentages, e.g. 50/50") from None
    return prefill, decode


def plan_cluster(args: argparse.Namespace, rest: list[str], run_dir: Path) -> ClusterPlan:
    """Every child with its argv: the launcher's flags, then its share of rest; each argv checked with its
    child's parser (the router's also gives the grace). ArgvError names the flag; nothing starts."""
    children = build_children(args, run_dir)
    set_by_launcher: dict[str, set[str]] = {cli.kind: set() for cli in CHILD_CLIS}
    for child in children:
        cli = cli_of(child)
        set_by_launcher[cli.kind] |= set(child.argv[CHILD_PREFIX:]) & cli.options().keys()
    shares = split_flags(rest, set_by_launcher)
    parsed = {}
    for child in children:
        child.argv += shares[cli_of(child).kind]
        parsed[child.name] = cli_of(child).parse(child.argv[CHILD_PREFIX:])
    return ClusterPlan([c for c in children if c.name in args.wanted], parsed[children[0].name].grace)


def cli_of(child: Child) -> ChildCli:
    return ROUTER if child.role == "router" else WORKER


def build_children(args: argparse.Namespace, run_dir: Path) -> list[Child]:
    """Every process of the cluster with the flags the launcher gives it (no other flags yet)."""
    py = sys.executable
    logs = run_dir / "logs"
    busy_poll_ms = busy_poll_seconds(args.busy_poll_ms, args.device) * 1e3
    common = ["--model", args.model, "--run-dir", str(run_dir), "--log-level", args.log_level]
    common += ["--busy-poll-ms", f"{busy_poll_ms:g}", "--block-size", str(args.block_size)]
    router = [py, "-m", "pdserve.router", *common, "--port", str(args.port), "--bind", args.bind]
    router += ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    children = []
    for k, name in enumerate(router_names(args.frontends)):
        plumbing = [] if args.frontends == 1 else ["--frontend", str(k), "--num-frontends", str(args.frontends)]
        metrics = _metrics_flag(args, 0 if k == 0 else args.prefill + args.decode + k)
        children.append(Child(name, [*router, *plumbing, *metrics], logs / f"{name}.log"))
    worker = [*common, "--device", args.device, "--num-prefill", str(args.prefill), "--num-decode", str(args.decode)]
    worker += ["--cpu-threads", str(cpu_threads(args))]
    if args.frontends > 1:
        worker += ["--num-frontends", str(args.frontends)]
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for i in range(count):
            offset = 1 + i + (args.prefill if role == "decode" else 0)
            argv = [py, "-m", f"pdserve.{role}_worker", *worker, "--tp-size", str(tp_size(args, role))]
            argv += ["--worker-id", str(i), *_metrics_flag(args, offset)]
            children.append(Child(f"{role}-{i}", argv, logs / f"{role}-{i}.log"))
    return children


def tp_size(args: argparse.Namespace, role: str) -> int:
    """The TP size of role's workers ("prefill" or "decode"), as _check_args resolved it."""
    return int(args.prefill_tp if role == "prefill" else args.decode_tp)


def cpu_threads(args: argparse.Namespace) -> int:
    """--cpu-threads of each worker process: as given, else the cores this process may use over the TP ranks of
    the workers it starts (each rank is a process of its own; a TP-2 worker counts 2).

    Each worker's torch would otherwise start a thread per core; on a CPU cluster N workers then run N x cores
    spinning threads on the cores, and every step waits on descheduled ones.
    """
    if args.cpu_threads is not None:
        return int(args.cpu_threads)
    ranks_here = sum(tp_size(args, name.split("-")[0]) for name in args.wanted if not name.startswith("router"))
    return max(1, len(os.sched_getaffinity(0)) // max(ranks_here, 1))


def _metrics_flag(args: argparse.Namespace, offset: int) -> list[str]:
    """--metrics-port of the child at offset (router 0, prefill i 1+i, decode j 1+P+j, front end k > 0 P+D+k);
    0 stays 0 (any free port), a negative base turns metrics off."""
    if args.metrics_port < 0:
        return []
    return ["--metrics-port", str(args.metrics_port + offset if args.metrics_port else 0)]


def cluster_keys(args: argparse.Namespace) -> ClusterKeys | None:
    """The CURVE keys of a cluster over hosts (None without --topology): --cluster-keys, made (0600) when missing
    by the launcher that starts the router; ValueError when another host's launcher finds none."""
    if args.topology is None:
        return None
    path = Path(args.cluster_keys or Path(args.topology).with_suffix(".keys"))
    if not path.exists() and any(name.startswith("router") for name in args.wanted):
        try:
            ClusterKeys.make().write(path)
            print(f"pdserve-cluster: made the cluster's CURVE keys {path}: copy it to every host", file=sys.stderr)
        except FileExistsError:
            pass  # another launcher made it meanwhile
    if not path.exists():
        raise ValueError(f"--cluster-keys {path}: no such file; copy it from the router's host (its launcher makes "
                         "it), keeping mode 0600")  # fmt: skip
    return ClusterKeys.read(path)


def make_run_dir(run_dir: Path) -> None:
    """run_dir and its logs/; a new run dir is 0700 (its ipc:// sockets are then closed to other users)."""
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    if run_dir.stat().st_mode & 0o077:
        print(f"pdserve-cluster: warning: other users may reach the sockets in {run_dir} (chmod 700 it)",
              file=sys.stderr)  # fmt: skip


def _mps(args: argparse.Namespace, run_dir: Path) -> Mps | None:
    """MPS when asked for, or (auto) when CUDA workers of both roles may share a GPU."""
    shared = roles_share_a_gpu(gpu_lists(args.prefill_gpus), gpu_lists(args.decode_gpus))
    auto = args.mps == "auto" and args.device.startswith("cuda") and shared
    wanted = not args.colocated and (args.mps == "on" or auto)
    return Mps(run_dir, args.mps_shares, args.whole_gpu) if wanted else None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parse_args(parser, argv)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
    try:
        plan = plan_cluster(args, rest, run_dir)
        keys = cluster_keys(args)
    except (ArgvError, ValueError) as exc:
        if args.run_dir is None:
            run_dir.rmdir()
        parser.error(str(exc))
    make_run_dir(run_dir)
    remove_tables(run_dir)  # a reused run dir's load counts are of front ends that are gone
    if args.topology_hosts is not None:  # every process reads both from its run dir (core/ipc.py)
        (run_dir / TOPOLOGY_FILE).write_text(json.dumps(asdict(args.topology_hosts)))
        (run_dir / KEYS_FILE).unlink(missing_ok=True)
        assert keys is not None
        keys.write(run_dir / KEYS_FILE)
    # the children run the installed pdserve (python -m pdserve.*): no PYTHONPATH of ours
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    supervisor = Supervisor(plan.children, run_dir, env, plan.grace, _mps(args, run_dir), args.gpus)
    return supervisor.run(f"{args.bind}:{args.port}")


if __name__ == "__main__":
    sys.exit(main())
