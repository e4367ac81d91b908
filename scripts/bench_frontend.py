#!/usr/bin/env python3
"""The front end's ceiling: one router process (or --frontends K on one port) between mock workers that stream as
fast as they can (router/benchmark/mock_worker.py, no model) and client processes that drive closed-loop streams,
at each concurrency level; per level responses/s (gRPC messages or SSE chunks), output tokens/s, completed
requests/s and TTFT p50/p99, as a table and as JSON with the host's facts and the command line.

    python scripts/bench_frontend.py --model MODEL_DIR --concurrency 1,16,64,256,1024 --output-len 128 \\
        --prefill 1 --decode 2 --client-processes 8 --result-json bench/out/frontend_grpc.json

--backend openai drives the router's HTTP door instead (POST /v1/completions, SSE) at the URL its ready line names.
--frontends K starts K router processes on one gRPC and one HTTP port (SO_REUSEPORT; pdserve-cluster --frontends),
the mock workers sending each request's tokens to its own front end; each gRPC client process then opens
--grpc-channels connections (default 1 for one router, 4 per front end otherwise), so that the kernel spreads them.
The model folder gives the router its tokenizer
(detokenizing is part of the front end's work) and the prompts their vocabulary; its weights are never read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pdserve.core.lifecycle import READY_MARK
from pdserve.router.benchmark.datasets import ClosedLoop, VocabInfo, Workload
from pdserve.router.benchmark.metrics import RequestRecord, compute_metrics
from pdserve.router.benchmark.run_config import RunConfig
from pdserve.router.benchmark.runner import run_in_processes
from pdserve.router.model_info import ModelSpec

READY_TIMEOUT_S = 60.0
HTTP_URL = re.compile(r"\(HTTP (\S+)\)")
"""The HTTP door's URL in the router's ready line (router/config.py HTTP_READY)."""
LEVEL_FIELDS = (
    ("concurrency", "conc", "d"),
    ("client_processes", "procs", "d"),
    ("responses_per_s", "resp/s", ".0f"),
    ("output_tokens_per_s", "out tok/s", ".0f"),
    ("requests_per_s", "req/s", ".1f"),
    ("ttft_p50_ms", "TTFT p50 ms", ".2f"),
    ("ttft_p99_ms", "TTFT p99 ms", ".2f"),
    ("itl_p99_ms", "ITL p99 ms", ".2f"),
    ("failed", "failed", "d"),
)
"""(JSON key, table header, format) of the table's columns."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model folder: config.json and tokenizer.json (no weights needed)")
    p.add_argument("--backend", choices=["grpc", "openai"], default="grpc")
    p.add_argument("--router-arg", action="append", default=[], help="one more router flag, e.g. --router-arg=--x=1")
    p.add_argument("--concurrency", default="1,16,64,256,1024", help="comma-separated streams per level")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of new requests per level")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of 16 streams before the first level (0: none)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens of every request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens of every request (ignore_eos)")
    p.add_argument("--prefill", type=int, default=1, help="mock prefill workers")
    p.add_argument("--decode", type=int, default=1, help="mock decode workers")
    p.add_argument("--step-ms", type=float, default=0.0, help="mock decode: least time between steps (0: none)")
    p.add_argument("--frontends", type=int, default=1, help="router processes sharing the ports (SO_REUSEPORT)")
    p.add_argument(
        "--grpc-channels", type=int, default=None,
        help="gRPC connections per client process (default: 1 for one router, else 4 per front end)",
    )  # fmt: skip
    cores = os.cpu_count() or 1
    p.add_argument(
        "--client-processes", type=int, default=max(1, min(8, cores // 2)), help="most load processes per level"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None, help="write the results here")
    args = p.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.levels or min(args.levels) < 1 or args.prefill < 0 or args.decode < 1 or args.frontends < 1:
        p.error("--concurrency needs levels >= 1; --prefill >= 0, --decode >= 1 and --frontends >= 1")
    if args.grpc_channels is None:
        args.grpc_channels = 1 if args.frontends == 1 else 4 * args.frontends
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FrontEnd:
    """The router process(es) and their mock workers, in a fresh run dir; logs go to run_dir/*.log."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.run_dir = Path(tempfile.mkdtemp(prefix="pdserve-frontend-"))
        self.procs: list[subprocess.Popen[str]] = []
        mock = [sys.executable, "-m", "pdserve.router.benchmark.mock_worker", "--run-dir", str(self.run_dir)]
        mock += ["--step-ms", str(args.step_ms), "--num-frontends", str(args.frontends)]
        for role, count in (("prefill", args.prefill), ("decode", args.decode)):
            for i in range(count):
                self._start(f"{role}-{i}", [*mock, "--role", role, "--worker-id", str(i)])
        router = [sys.executable, "-m", "pdserve.router", "--model", args.model, "--run-dir", str(self.run_dir)]
        router += ["--prefill", str(args.prefill), "--decode", str(args.decode), "--block-size", "16"]
        router += ["--log-level", "WARNING"]
        if args.frontends == 1:
            router += ["--port", "0"]
        else:  # NOTE: the front ends share fixed ports
            router += ["--port", str(free_port()), "--http-port", str(free_port())]
            router += ["--num-frontends", str(args.frontends)]
        self.routers = []
        for k in range(args.frontends):
            plumbing = [] if args.frontends == 1 else ["--frontend", str(k)]
            name = "router" if args.frontends == 1 else f"router-{k}"
            self.routers.append(self._start(name, [*router, *plumbing, *args.router_arg], stdout=subprocess.PIPE))
        self.address, self.http_url = self._wait_ready()

    def _start(self, name: str, argv: list[str], stdout: Any = None) -> subprocess.Popen[str]:
        log = open(self.run_dir / f"{name}.log", "w")  # noqa: SIM115 - the child holds it
        proc = subprocess.Popen(argv, stdout=stdout or log, stderr=log, text=True)
        self.procs.append(proc)
        return proc

    def _wait_ready(self) -> tuple[str, str | None]:
        """The routers' gRPC address and HTTP URL (None: no HTTP door), from their ready lines (all of them)."""
        found: list[str] = []

        def read(router: subprocess.Popen[str]) -> None:
            assert router.stdout is not None
            for line in router.stdout:
                if line.startswith(READY_MARK):
                    found.append(line)

        for router in self.routers:
            threading.Thread(target=read, args=(router,), daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(found) < len(self.routers):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.stop()
                raise RuntimeError(f"the router did not get ready; logs in {self.run_dir}")
            time.sleep(0.05)
        http = HTTP_URL.search(found[0])
        return found[0].removeprefix(READY_MARK).split()[0], None if http is None else http.group(1)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def level_result(records: list[RequestRecord], concurrency: int, processes: int) -> dict[str, Any]:
    """One level's figures; a record with another output length than asked counts as failed."""
    wrong = [r for r in records if r.ok and r.output_tokens != r.expected_output_len]
    bad = {id(r) for r in wrong}
    good = [r for r in records if id(r) not in bad]
    m = compute_metrics(good, (50, 99))
    duration = m["duration"]
    responses = sum(len(r.response_times) for r in good if r.ok)
    errors = sorted({r.error or f"{r.output_tokens} tokens" for r in records if not r.ok or id(r) in bad})
    return {
        "concurrency": concurrency,
        "client_processes": processes,
        "duration_s": duration,
        "completed": m["completed"],
        "failed": m["failed"] + len(wrong),
        "responses": responses,
        "output_tokens": m["total_output_tokens"],
        "responses_per_s": responses / duration if duration > 0 else 0.0,
        "output_tokens_per_s": m["output_throughput"],
        "requests_per_s": m["request_throughput"],
        "ttft_p50_ms": m["p50_ttft_ms"],
        "ttft_p99_ms": m["p99_ttft_ms"],
        "itl_p50_ms": m["p50_itl_ms"],
        "itl_p99_ms": m["p99_itl_ms"],
        "errors": errors[:5],
    }


def run_level(config: RunConfig, args: argparse.Namespace, vocab: VocabInfo, streams: int, seconds: float) -> dict:
    loop = ClosedLoop(streams, seconds, args.input_len, args.output_len, vocab, args.seed + streams)
    processes = min(args.client_processes, streams)
    records = run_in_processes(Workload((), loop), config, processes)
    return level_result(records, streams, processes)


def host_facts() -> dict[str, Any]:
    cpu = None
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "num_cpus_usable": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
    }


def table_header() -> str:
    return "  ".join(header.rjust(max(len(header), 9)) for _, header, _ in LEVEL_FIELDS)


def table_row(level: dict[str, Any]) -> str:
    return "  ".join(format(level[key], fmt).rjust(max(len(header), 9)) for key, header, fmt in LEVEL_FIELDS)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    model = ModelSpec.from_dir(args.model)
    vocab = VocabInfo(model.vocab_size, model.eos_token_ids)
    front = FrontEnd(args)
    address = front.address if args.backend == "grpc" else front.http_url
    if address is None:
        front.stop()
        raise SystemExit("the router has no HTTP door (its ready line names no URL)")
    config = RunConfig(address, show_progress=False, backend=args.backend, model_name=model.name,
                       grpc_channels=args.grpc_channels)  # fmt: skip
    levels = []
    routers = "one router" if args.frontends == 1 else f"{args.frontends} routers on one port"
    print(
        f"{args.backend} door of {routers}; {args.prefill} prefill + {args.decode} decode mock workers; "
        f"{args.input_len} in / {args.output_len} out tokens; {args.duration:g} s per level\n{table_header()}"
    )
    try:
        if args.warmup > 0:
            run_level(config, args, vocab, 16, args.warmup)
        for streams in args.levels:
            levels.append(run_level(config, args, vocab, streams, args.duration))
            print(table_row(levels[-1]), flush=True)
    finally:
        front.stop()
    report = {
        "benchmark": "frontend",
        "argv": [sys.argv[0], *argv],
        "host": host_facts(),
        "config": {**{k: v for k, v in vars(args).items() if k != "levels"}, "router_address": address},
        "run_config": dataclasses.asdict(config),
        "levels": levels,
    }
    if args.result_json:
        out = Path(args.result_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(level["failed"] == 0 for level in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
