#!/usr/bin/env python3
"""Starts router + N prefill + M decode processes and keeps them up (per-role supervision); with
--colocated, router + M decode workers that prefill their own requests (no KV handoff, no MPS split).

A crashed worker restarts with exponential backoff; the router learns of it from the new incarnation in
its heartbeats and fails or re-routes what the old one held, and the prefill workers reclaim leases. One
line is printed when the cluster serves; SIGTERM / SIGINT stop the router first (it finishes
streams in flight within --grace seconds and refuses new calls), then the workers.

Why our own supervisor and not circus / supervisord: the roles need a per-cluster run directory for
their ipc sockets and logs, a readiness line that depends on the router having seen every role, and
exactly-once cleanup of the cluster on Ctrl-C; that is ~200 lines of stdlib here, versus a daemon with its
own config files, sockets and lifecycle to manage around it. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.core.busy_poll import busy_poll_seconds
from pdserve.core.ipc import TOPOLOGY_FILE, Topology

READY_MARK = "pdserve router ready on"
MAX_BACKOFF_S = 10.0
STABLE_AFTER_S = 30.0
STARTUP_ERROR_EXIT = 2
"""Exit code of a child that cannot start (bad flag, missing model, port in use): restarting cannot help."""
RESTARTS_ENV = "PDSERVE_RESTARTS"
"""Tells a worker how often it was restarted (its pdserve_process_restarts metric; core/worker_base.py)."""
STOP_MARGIN_S = 5.0
"""Seconds a child gets past its own grace to exit on SIGTERM before it is killed."""


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    backoff: float = 0.5
    history: list[float] = field(default_factory=list)
    log_offset: int = 0
    """Size of the log when the current process started."""

    def start(self, env: dict[str, str]) -> None:
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns the handle
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self.started_at = time.monotonic()

    def log_text_since_start(self) -> str:
        """What the current process wrote to its log."""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")

    def status(self) -> dict[str, object]:
        alive = self.proc is not None and self.proc.poll() is None
        return {
            "name": self.name,
            "pid": self.proc.pid if self.proc else None,
            "state": "running" if alive else "restarting",
            "restarts": self.restarts,
            "uptime_s": round(time.monotonic() - self.started_at, 1) if alive else 0.0,
            "log": str(self.log_path),
        }


def build_children(args: argparse.Namespace, run_dir: Path, extra: list[str]) -> list[Child]:
    py = sys.executable
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    busy_poll_ms = busy_poll_seconds(args.busy_poll_ms, args.device) * 1e3
    common = ["--model", args.model, "--run-dir", str(run_dir), "--log-level", args.log_level]
    common += ["--busy-poll-ms", f"{busy_poll_ms:g}"]
    worker = [*common, "--device", args.device, "--transport", args.transport, "--block-size", str(args.block_size)]
    worker += extra
    worker += ["--num-prefill", str(args.prefill), "--num-decode", str(args.decode)]
    children = [
        Child(
            "router",
            [py, "-m", "pdserve.router", *common, "--port", str(args.port), "--bind", args.bind]
            + ["--prefill", str(args.prefill), "--decode", str(args.decode), "--routing", args.routing]
            + ["--block-size", str(args.block_size), "--grace", str(args.grace)]
            + ["--max-migrations", str(args.max_migrations), "--max-queued", str(args.max_queued)]
            + _metrics_flag(args, 0)
            + (["--conditional-disagg"] if args.conditional_disagg else []),
            logs / "router.log",
        )
    ]
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for i in range(count):
            offset = 1 + i + (args.prefill if role == "decode" else 0)
            argv = [py, "-m", f"pdserve.{role}_worker", *worker, "--worker-id", str(i), *_metrics_flag(args, offset)]
            children.append(Child(f"{role}-{i}", argv, logs / f"{role}-{i}.log"))
    return children


def _metrics_flag(args: argparse.Namespace, offset: int) -> list[str]:
    """--metrics-port of the child at offset (router 0, prefill i 1+i, decode j 1+P+j); 0 stays 0 (any free
    port), a negative base turns metrics off."""
    if args.metrics_port < 0:
        return []
    return ["--metrics-port", str(args.metrics_port + offset if args.metrics_port else 0)]


def read_topology(path: Path, num_prefill: int, num_decode: int) -> Topology:
    """The topology (core/ipc.py Topology.read), checked against the worker counts; ValueError."""
    topo = Topology.read(path)
    if (len(topo.prefill), len(topo.decode)) != (num_prefill, num_decode):
        raise ValueError(
            f"topology {path} names {len(topo.prefill)} prefill and {len(topo.decode)} decode hosts for "
            f"{num_prefill} prefill and {num_decode} decode workers"
        )
    return topo


def gpu_lists(spec: str | None) -> list[str] | None:
    """'0,1' -> ['0', '1']; None or '' -> None (the default device placement)."""
    if not spec:
        return None
    gpus = [g.strip() for g in spec.split(",") if g.strip()]
    if not gpus:
        raise ValueError(f"no GPU in {spec!r}")
    return gpus


def placement(prefill_gpus: list[str] | None, decode_gpus: list[str] | None, num_prefill: int, num_decode: int
              ) -> dict[str, str]:  # fmt: skip
    """CUDA_VISIBLE_DEVICES of each worker ({} without --prefill-gpus / --decode-gpus): prefill i gets
    prefill_gpus[i % n]; decode j gets decode_gpus[j % m] first (its "cuda") and then every prefill GPU, whose
    pools it maps by CUDA IPC and copies from (peer copies; kvtransfer/cuda_ipc.py finds them by UUID)."""
    if prefill_gpus is None and decode_gpus is None:
        return {}
    prefill_gpus = prefill_gpus or decode_gpus
    decode_gpus = decode_gpus or prefill_gpus
    assert prefill_gpus is not None and decode_gpus is not None
    env = {f"prefill-{i}": prefill_gpus[i % len(prefill_gpus)] for i in range(num_prefill)}
    for j in range(num_decode):
        own = decode_gpus[j % len(decode_gpus)]
        env[f"decode-{j}"] = ",".join([own, *dict.fromkeys(g for g in prefill_gpus if g != own)])
    return env


def roles_share_a_gpu(prefill_gpus: list[str] | None, decode_gpus: list[str] | None) -> bool:
    """Whether a prefill and a decode worker may run on one GPU (then MPS splits its SMs between them)."""
    if prefill_gpus is None or decode_gpus is None:
        return True
    return bool(set(prefill_gpus) & set(decode_gpus))


class Mps:
    """An MPS control daemon private to this cluster (own pipe and log folders), so prefill and decode on
    one GPU each get a fixed share of its SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) instead of time slices."""

    def __init__(self, run_dir: Path, split: tuple[int, int]) -> None:
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(run_dir / "mps" / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(run_dir / "mps" / "log"),
        }
        self.split = split

    def start(self, env: dict[str, str]) -> bool:
        exe = shutil.which("nvidia-cuda-mps-control")
        if exe is None:
            print("pdserve: nvidia-cuda-mps-control not found; running without MPS", file=sys.stderr)
            return False
        for folder in self.env.values():
            Path(folder).mkdir(parents=True, exist_ok=True)
        subprocess.run([exe, "-d"], env={**env, **self.env}, check=True)
        print(f"pdserve: MPS on, SM share prefill/decode {self.split[0]}/{self.split[1]}%", file=sys.stderr)
        return True

    def role_env(self, role: str) -> dict[str, str]:
        share = {"prefill": self.split[0], "decode": self.split[1]}.get(role)
        return {**self.env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(share)} if share is not None else {}

    def stop(self, env: dict[str, str]) -> None:
        exe = shutil.which("nvidia-cuda-mps-control")
        if exe is not None:
            subprocess.run([exe], input=b"quit\n", env={**env, **self.env}, check=False, timeout=30)


class Supervisor:
    def __init__(
        self, children: list[Child], run_dir: Path, env: dict[str, str], grace: float, mps: Mps | None = None,
        gpus: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.gpus = gpus or {}
        """Child name -> CUDA_VISIBLE_DEVICES (placement())."""
        self.children = children
        self.grace = grace
        self.run_dir = run_dir
        self.env = env
        self.mps = mps
        self.stopping = False
        self.ready = False
        self.failure: str | None = None

    def run(self, address: str) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        if self.mps is not None and not self.mps.start(self.env):
            self.mps = None
        for child in self.children:
            child.start(self._env_for(child))
        while not self.stopping:
            self._reap_and_restart()
            self._check_ready(address)
            self._write_status()
            time.sleep(0.1)
        self._shutdown()
        if self.failure is not None:
            print(self.failure, file=sys.stderr, flush=True)
            return 1
        return 0

    def _reap_and_restart(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None:
                code = child.proc.returncode
                if not self.ready and code == STARTUP_ERROR_EXIT:  # NOTE: the cluster never came up: give up
                    lines = child.log_text_since_start().strip().splitlines() or ["(no output)"]
                    self.failure = f"pdserve: {child.name} failed to start: {lines[-1]}"
                    self.stopping = True
                    return
                if now - child.started_at > STABLE_AFTER_S:
                    child.backoff = 0.5
                print(f"pdserve: {child.name} exited ({code}); restarting in {child.backoff:.1f}s", file=sys.stderr)
                child.proc = None
                child.next_start = now + child.backoff
                child.backoff = min(child.backoff * 2, MAX_BACKOFF_S)
            if child.proc is None and now >= child.next_start:
                child.restarts += 1
                child.history.append(time.time())
                child.start(self._env_for(child))

    def _env_for(self, child: Child) -> dict[str, str]:
        env = {**self.env, RESTARTS_ENV: str(child.restarts)}
        if child.name in self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[child.name]
        return {**env, **self.mps.role_env(child.name.split("-")[0])} if self.mps else env

    def _check_ready(self, address: str) -> None:
        if self.ready:
            return
        router = next((c for c in self.children if c.name == "router"), None)
        if router is None:  # NOTE: a host of workers only (--roles): ready once each has heartbeaten
            if all(self._heartbeat_pid(c) == (c.proc.pid if c.proc else None) for c in self.children):
                self.ready = True
                names = ", ".join(c.name for c in self.children)
                print(f"pdserve workers ready: {names} (run dir {self.run_dir})", flush=True)
            return
        # NOTE: logs are appended to: only what this run's router wrote counts (a reused run dir holds old lines)
        if router.log_path.exists() and READY_MARK in router.log_text_since_start():
            self.ready = True
            print(f"pdserve cluster ready on {address} (run dir {self.run_dir})", flush=True)

    def _heartbeat_pid(self, child: Child) -> int | None:
        """The pid in child's latest heartbeat stats (None before the first)."""
        try:
            return int(json.loads((self.run_dir / "stats" / f"{child.name}.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    def _write_status(self) -> None:
        status = {"pid": os.getpid(), "ready": self.ready, "roles": [c.status() for c in self.children]}
        tmp = self.run_dir / "status.json.tmp"
        tmp.write_text(json.dumps(status, indent=1))
        tmp.replace(self.run_dir / "status.json")

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _shutdown(self) -> None:
        # NOTE: the router first: it refuses new calls and lets streams in flight finish within its grace,
        # which needs the workers still up; only then are the workers stopped.
        router = [c for c in self.children if c.name == "router"]
        workers = [c for c in self.children if c.name != "router"]
        _terminate(router, self.grace + STOP_MARGIN_S)
        _terminate(workers, STOP_MARGIN_S)
        if self.mps is not None:
            self.mps.stop(self.env)
        print("pdserve: stopped", file=sys.stderr, flush=True)


def _terminate(children: list[Child], timeout: float) -> None:
    """SIGTERM the live ones, wait up to `timeout` seconds for all of them, then kill what is left."""
    procs = [c.proc for c in children if c.proc is not None and c.proc.poll() is None]
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description="Run a pdserve cluster under supervision.")
    p.add_argument("--model", required=True)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "shm", "cuda_ipc", "dist"],
        help="auto: per prefill/decode pair, cuda_ipc (CUDA) or shm (CPU) within a host, dist across hosts; "
        "or one transport for every pair",
    )
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--bind", default="127.0.0.1")
    p.add_argument("--run-dir", default=None)
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
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="every process; WARNING drops the per-request lines",
    )
    p.add_argument(
        "--busy-poll-ms",
        type=float,
        default=None,
        help="every process: after work, poll without sleeping this long (default: 1000 on CUDA, 0 on CPU)",
    )
    _add_router_args(p)
    _add_placement_args(p)
    args, extra = p.parse_known_args(argv)
    _check_args(p, args)
    return args, extra


def _add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grace", type=float, default=5.0, help="router: seconds streams get to finish on SIGTERM")
    p.add_argument("--routing", choices=["prefix", "round_robin"], default="prefix", help="router: prefill choice")
    p.add_argument(
        "--conditional-disagg",
        action="store_true",
        help="router: a decode worker holding all but a short prompt tail (<= 64 tokens) computes it itself",
    )
    p.add_argument(
        "--max-migrations",
        type=int,
        default=2,
        help="router: times a request of a crashed worker is resumed on another (prompt + tokens so far; 0: fail)",
    )
    p.add_argument(
        "--max-queued", type=int, default=1024, help="router: requests that may wait for KV room (more: refused)"
    )


def _add_placement_args(p: argparse.ArgumentParser) -> None:
    """Where the processes run: MPS, GPUs, hosts."""
    p.add_argument(
        "--mps",
        choices=["auto", "on", "off"],
        default="auto",
        help="MPS SM partitioning between roles sharing a GPU (auto: on for --device cuda)",
    )
    p.add_argument("--mps-split", default="50/50", help="SM share in percent, prefill/decode (default 50/50)")
    p.add_argument("--prefill-gpus", default=None, help="GPUs of the prefill workers, e.g. 0 or 0,1 (round robin)")
    p.add_argument(
        "--decode-gpus", default=None, help="GPUs of the decode workers; MPS (auto) only where roles share a GPU"
    )
    p.add_argument(
        "--topology",
        default=None,
        help="JSON {router: host, prefill: [hosts], decode: [hosts], base_port}: a cluster over several hosts, "
        "TCP between its processes (docs/deployment.md)",
    )
    p.add_argument("--roles", default=None, help="start only these processes here, e.g. router or prefill-0,decode-0")


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Cross-flag checks and derived values (topology, colocated)."""
    topology = None
    if args.topology is not None:
        try:
            topology = read_topology(Path(args.topology), args.prefill, args.decode)
        except ValueError as exc:
            p.error(str(exc))
    args.topology_hosts = topology
    if args.colocated:
        args.prefill = 0
    elif args.prefill < 1:
        p.error("--prefill must be >= 1 (or use --colocated)")
    if args.decode < 1:
        p.error("--decode must be >= 1")
    try:
        gpu_lists(args.prefill_gpus), gpu_lists(args.decode_gpus)
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pdserve-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    children = build_children(args, run_dir, extra)
    if args.topology_hosts is not None:  # NOTE: every process reads it from its run dir (core/ipc.py)
        (run_dir / TOPOLOGY_FILE).write_text(json.dumps(asdict(args.topology_hosts)))
    if args.roles:
        wanted = {r.strip() for r in args.roles.split(",") if r.strip()}
        unknown = wanted - {c.name for c in children}
        if unknown:
            print(f"pdserve: unknown roles {sorted(unknown)}", file=sys.stderr)
            return STARTUP_ERROR_EXIT
        children = [c for c in children if c.name in wanted]
    prefill_gpus, decode_gpus = gpu_lists(args.prefill_gpus), gpu_lists(args.decode_gpus)
    gpus = placement(prefill_gpus, decode_gpus, args.prefill, args.decode)
    shared = roles_share_a_gpu(prefill_gpus, decode_gpus)
    mps = None
    auto = args.mps == "auto" and args.device.startswith("cuda") and shared
    if not args.colocated and (args.mps == "on" or auto):
        prefill_share, decode_share = (int(x) for x in args.mps_split.split("/"))
        mps = Mps(run_dir, (prefill_share, decode_share))
    return Supervisor(children, run_dir, env, args.grace, mps, gpus).run(f"{args.bind}:{args.port}")


if __name__ == "__main__":
    sys.exit(main())
