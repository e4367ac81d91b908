#!/usr/bin/env python3
"""The serving figures of issue 5 on one GPU: clusters started here, loads from `pdserve-bench-serving`.

    python scripts/bench_serving_suite.py --part disagg --out bench/out/serving
    python scripts/bench_serving_suite.py --part colocated --out bench/out/serving

Parts (each fits one ~10-minute device call):
- disagg: a prefill + a decode worker on one GPU under a 50/50 MPS split. Long-prompt interference (64
  short streams x 256 tokens, 4000-token prompts at 2/s) and the same short streams alone (decode-only);
  shared prefix (900 + 100 tokens, 30 out; the prefixes cached first) at 1, 5, 10, 20 req/s; the exact
  whole-prompt hit; random 512-2048 in / 128-512 out at a Poisson rate. Then the same cluster without the
  prefix cache for the shared-prefix rates.
- colocated: one worker doing prefill (chunked) and decode: interference and the random load.
- transformers: the random load through transformers `generate` in static batches.
- frontdoor (issue 35): the cluster at 64 and 256 concurrent streams through the gRPC and the HTTP door.
- moe_interference (issue 36): the interference runs (disaggregated, decode-only, colocated) on the
  qwen3-30b-a3b shape. On one GPU it keeps MOE_LAYERS of its 48 layers: a worker of all 48 holds ~61 GB of bf16
  weights, two of them fit no single GPU; every run's JSON says so ("moe_setup"). --moe-gpus 2 runs the whole
  model with prefill on GPU 0 and decode on GPU 1 (colocated: one worker per GPU), as two_gpus does.
- routing (issue 6): 2 prefill workers + 1 decode worker, prefix-aware routing vs round-robin: a shared-prefix
  load whose prefixes fit one worker's KV pool only in part (cache-hit token ratio, TTFT), and a burst of 32
  requests with the same token ids, half sent as text (prefill forward passes, TTFT).
Each run writes its own JSON (and PNGs) under --out; summary.json collects the headline numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.core.step_timer import quantile_ms
from pdserve.router.benchmark import cli as bench

ROOT = Path(__file__).resolve().parents[1]

PORT = 50071
HTTP_PORT = PORT + 1
"""The router's OpenAI-compatible HTTP door (its default: --port + 1)."""
DEVICE = "cuda"
WORKER_FLAGS = ["--dtype", "bfloat16", "--load-format", "dummy", "--max-num-seqs", "128"]
COLOCATED_FLAGS = ["--colocated", "--max-num-batched-tokens", "2048", "--prefill-chunk-size", "2048"]
GOODPUT = ["--goodput", "ttft:1000", "tpot:50"]
INTERFERENCE = ["--dataset", "long-prompt", "--num-short", "64", "--short-output-len", "256"]
INTERFERENCE += ["--long-input-len", "4000", "--long-output-len", "16", "--client-processes", "4"]
RANDOM = ["--dataset", "random", "--num-prompts", "100", "--input-len", "512:2048", "--output-len", "128:512"]
RANDOM += ["--request-rate", "4", *GOODPUT]
WARMUP = ["--dataset", "random", "--num-prompts", "48", "--input-len", "8:4000", "--output-len", "4:8"]
WITH_LONG = [*INTERFERENCE, "--long-rate", "2", "--duration", "15"]
"""The interference load: short streams plus 4000-token prompts at 2/s."""
DECODE_ONLY = [*INTERFERENCE, "--long-rate", "0", "--duration", "10"]
"""The same short streams alone."""
SHARED_RATES = (1, 5, 10, 20)
SHARED_SECONDS = 10
"""Seconds of arrivals in each shared-prefix run (10 prompts at 1/s, 200 at 20/s)."""
EXACT_PREFIX = "1000"


def num_prefill_workers(flags: list[str]) -> int:
    if "--colocated" in flags:
        return 0
    return int(flags[flags.index("--prefill") + 1]) if "--prefill" in flags else 1


class Cluster:
    """pdserve-cluster (router/cluster_cli.py) in the background, on one GPU."""

    def __init__(self, model: Path, run_dir: Path, flags: list[str], log: Path) -> None:
        self.run_dir = run_dir
        self.num_prefill = num_prefill_workers(flags)
        argv = [sys.executable, "-m", "pdserve.router.cluster_cli", "--model", str(model), "--device", DEVICE]
        argv += ["--port", str(PORT), "--run-dir", str(run_dir), *flags]
        self.log = log
        self.proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115

    def wait_ready(self, timeout: float = 300.0) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if "pdserve cluster ready on" in self.log.read_text(errors="replace"):
                return time.monotonic() - start
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError(f"cluster not ready:\n{self.log.read_text(errors='replace')[-4000:]}")

    def decode_counters(self) -> dict[str, int]:
        """The decode worker's latest heartbeat counters (its step-interval histogram among them)."""
        time.sleep(0.6)  # NOTE: two heartbeat intervals, so the snapshot covers the run's last steps
        return self.counters("decode-0")

    def counters(self, worker: str) -> dict[str, int]:
        """A worker's (e.g. "prefill-1") latest heartbeat counters."""
        stats = json.loads((self.run_dir / "stats" / f"{worker}.json").read_text())
        return stats["counters"]  # type: ignore[no-any-return]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_bench(cluster: Cluster, out: Path, name: str, args: list[str]) -> dict[str, Any]:
    """One pdserve-bench-serving run against the cluster on PORT; its JSON report, with the decode worker's
    step intervals during the run added (`worker_step_ms`: the ITL at the engine, bucket upper bounds)."""
    path = out / f"{name}.json"
    port = HTTP_PORT if "openai" in args else PORT
    argv = ["--address", f"127.0.0.1:{port}", "--no-progress", "--save-detailed", "--result-json", str(path), *args]
    started, before = time.monotonic(), cluster.decode_counters()
    forwards, compiles = prefill_forwards(cluster), jit_compiles(cluster)
    code = bench.main(argv)
    after = cluster.decode_counters()
    report = json.loads(path.read_text())
    report["prefill_forward_calls"] = prefill_forwards(cluster) - forwards
    report["jit_compiles_serving"] = jit_compiles(cluster) - compiles  # NOTE: each stalls a worker
    report["decode_prefill_tokens"] = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    steps = {f"p{int(q * 100)}": quantile_ms(before, after, q) for q in (0.5, 0.9, 0.99)}
    report["worker_step_ms"] = {k: "inf" if v == float("inf") else v for k, v in steps.items()}
    report["gpu"] = gpu_name()
    path.write_text(json.dumps(report, indent=1))
    print(f"== {name}: exit {code}, {time.monotonic() - started:.1f} s, decode steps {steps}, "
          f"JIT compiles {report['jit_compiles_serving']}", flush=True)  # fmt: skip
    return report  # type: ignore[no-any-return]


def prefill_forwards(cluster: Cluster) -> int:
    """Forward passes of every prefill worker so far (their heartbeat counters)."""
    return sum(cluster.counters(f"prefill-{i}")["forward_calls"] for i in range(cluster.num_prefill))


def jit_compiles(cluster: Cluster) -> int:
    """Triton kernel variants every worker compiled after its warm-up so far."""
    workers = [f"prefill-{i}" for i in range(cluster.num_prefill)] + ["decode-0"]
    return sum(cluster.counters(w).get("jit_compiles_serving", 0) for w in workers)


def with_cluster(model: Path, out: Path, label: str, flags: list[str], runs: list[tuple[str, list[str]]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # NOTE: the run folder (sockets, logs) lives outside `out`: a device call brings back few files
    run_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-suite-{label}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cluster = Cluster(model, run_dir, flags, out / f"cluster-{label}.log")
    try:
        print(f"== cluster {label} ready in {cluster.wait_ready():.1f} s", flush=True)
        run_bench(cluster, out, f"warmup-{label}", WARMUP)  # NOTE: first prefills of each shape compile kernels
        for name, args in runs:
            run_bench(cluster, out, name, args)
    finally:
        cluster.stop()
        late = [line for log in sorted((run_dir / "logs").glob("*.log")) for line in log.read_text(errors="replace")
                .splitlines() if "while serving" in line]  # fmt: skip
        (out / f"jit-{label}.txt").write_text("\n".join(late) + "\n")


def shared_prefix_runs(label: str) -> list[tuple[str, list[str]]]:
    """Per rate: the 8 prefixes alone, one request each (in the cache from then on, as a system prompt is in
    steady state), then SHARED_SECONDS of Poisson arrivals of prefix + unique suffix. Each rate has its own
    seed, so its prefixes and suffixes are its own.

    NOTE: with one seed for every rate (before 2026-11-24) the suffixes repeated across the runs of a cluster
    (a fixed output length draws nothing from the generator): half the prompts at 10 and 20/s were whole-prompt
    hits of an earlier run, and the 8 prompts at 1/s were all misses.
    """
    base = ["--dataset", "shared-prefix", "--num-groups", "8", "--prefix-len", "900"]
    runs = []
    for rate in SHARED_RATES:
        seed = ["--seed", str(rate)]
        warm = [*base, "--suffix-len", "0", "--output-len", "1", "--num-prompts", "8", "--max-concurrency", "1"]
        load = [*base, "--suffix-len", "100", "--output-len", "30", "--request-rate", str(rate)]
        load += ["--num-prompts", str(SHARED_SECONDS * rate)]
        runs += [(f"prefixes-{label}-rate{rate}", [*warm, *seed]), (f"shared-{label}-rate{rate}", [*load, *seed])]
    return runs


EXACT = ["--dataset", "shared-prefix", "--num-groups", "1", "--prefix-len", EXACT_PREFIX, "--suffix-len", "0"]
EXACT += ["--output-len", "1", "--num-prompts", "200", "--max-concurrency", "1"]


def part_shared(model: Path, out: Path) -> None:
    """The shared-prefix rates with and without the prefix cache, and the exact hit (a subset of disagg)."""
    with_cluster(model, out, "disagg", WORKER_FLAGS, [*shared_prefix_runs("cache"), ("exact-hit", EXACT)])
    with_cluster(model, out, "disagg-nocache", [*WORKER_FLAGS, "--no-prefix-caching"], shared_prefix_runs("nocache"))


def part_exact(model: Path, out: Path) -> None:
    """The exact whole-prompt hit alone (TTFT end to end through gRPC)."""
    with_cluster(model, out, "disagg", WORKER_FLAGS, [("exact-hit", EXACT)])


def part_disagg(model: Path, out: Path) -> None:
    runs = [
        ("interference-disagg", WITH_LONG),
        ("interference-decode-only", DECODE_ONLY),
        *shared_prefix_runs("cache"),
        ("exact-hit", EXACT),
        ("random-disagg", RANDOM),
    ]
    with_cluster(model, out, "disagg", WORKER_FLAGS, runs)
    with_cluster(model, out, "disagg-nocache", [*WORKER_FLAGS, "--no-prefix-caching"], shared_prefix_runs("nocache"))


ROUTING_FLAGS = [*WORKER_FLAGS, "--prefill", "2", "--num-blocks", "2000"]
ROUTING_SHARED = ["--dataset", "shared-prefix", "--num-groups", "32", "--prefix-len", "1500", "--suffix-len", "100"]
ROUTING_SHARED += ["--output-len", "16", "--num-prompts", "320", "--request-rate", "20"]
ROUTING_BURST = ["--dataset", "duplicate", "--num-groups", "1", "--copies", "32", "--num-words", "1000"]
ROUTING_BURST += ["--output-len", "16", "--request-rate", "inf"]


def part_routing(model: Path, out: Path) -> None:
    """32 prefixes of 94 blocks (3000 blocks) over two prefill workers of 2000 blocks: prefix-aware routing can
    keep each prefix on one worker, round-robin makes both hold all of them. Prefill forward passes of each
    run (both workers) go into its JSON."""
    for policy in ("prefix", "round_robin"):
        burst = [*ROUTING_BURST, "--model-dir", str(model)]  # NOTE: the tokenizer that makes the texts
        runs = [(f"routing-shared-{policy}", ROUTING_SHARED), (f"routing-burst-{policy}", burst)]
        with_cluster(model, out, f"routing-{policy}", [*ROUTING_FLAGS, "--routing", policy], runs)


LOCAL_TAIL = ["--dataset", "shared-prefix", "--num-groups", "8", "--prefix-len", "900", "--suffix-len", "32"]
LOCAL_TAIL += ["--output-len", "30", "--num-prompts", "160", "--request-rate", "20"]


def part_conditional(model: Path, out: Path) -> None:
    """Conditional disaggregation on and off: shared prefixes with 32-token suffixes, which the decode worker
    (holding each prefix after its group's first handoff) computes itself when on."""
    for label, flags in (("on", ["--conditional-disagg"]), ("off", [])):
        runs = [(f"conditional-{label}", LOCAL_TAIL)]
        with_cluster(model, out, f"conditional-{label}", [*WORKER_FLAGS, *flags], runs)


def part_interference(model: Path, out: Path) -> None:
    """The three interference runs alone (disaggregated, decode-only, colocated)."""
    runs = [
        ("interference-disagg", WITH_LONG),
        ("interference-decode-only", DECODE_ONLY),
    ]
    with_cluster(model, out, "disagg", WORKER_FLAGS, runs)
    runs = [("interference-colocated", WITH_LONG)]
    with_cluster(model, out, "colocated", [*WORKER_FLAGS, *COLOCATED_FLAGS], runs)


def part_two_gpus(model: Path, out: Path) -> None:
    """Issue 9: the interference runs with prefill on GPU 0 and decode on GPU 1 (no MPS: no GPU is shared), and
    colocated on the same two GPUs (one worker per GPU, each prefilling its own requests)."""
    runs = [
        ("interference-2gpu-disagg", WITH_LONG),
        ("interference-2gpu-decode-only", DECODE_ONLY),
    ]
    with_cluster(model, out, "2gpu-disagg", [*WORKER_FLAGS, "--prefill-gpus", "0", "--decode-gpus", "1"], runs)
    colocated = [*WORKER_FLAGS, *COLOCATED_FLAGS, "--decode", "2", "--decode-gpus", "0,1"]
    runs = [("interference-2gpu-colocated", WITH_LONG)]
    with_cluster(model, out, "2gpu-colocated", colocated, runs)


MOE_LAYERS = 16
"""Layers of the qwen3-30b-a3b shape a one-GPU MoE run keeps: two workers of ~21 GB of weights each (experts 1.2 GB
a layer, embedding and lm_head 1.2 GB) and their KV pools fit an 80 GB H100."""
MOE_KV_BYTES = 4 << 30
"""Each MoE worker's KV pool, as a fixed --num-blocks (two workers sizing theirs from free memory at once race)."""


def moe_model(layers: int) -> Path:
    """The qwen3-30b-a3b shape's config.json with its first `layers` layers, and the router's tokenizer."""
    from bench_moe import write_model

    from pdserve.core.model_store import write_gpt2_tokenizer

    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-qwen3-30b-a3b-{layers}-layers"
    write_gpt2_tokenizer(write_model("qwen3-30b-a3b", folder, {"num_hidden_layers": layers}))
    return folder


def kv_block_bytes(model: Path, block_size: int = 16) -> int:
    """Bytes of one bf16 KV block of the model in every layer (K and V)."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * head_dim * 2


def part_moe_interference(model: Path, out: Path, num_gpus: int) -> None:
    """Issue 36: the interference runs on an MoE model (see the module docstring), disaggregated and colocated,
    on one GPU (MPS 50/50) or two; the setup (layers kept and why, placement, pool) goes into each run's JSON and
    into {tag}-setup.json."""
    pool = [*WORKER_FLAGS, "--num-blocks", str(MOE_KV_BYTES // kv_block_bytes(model))]
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    two = ["--prefill-gpus", "0", "--decode-gpus", "1"] if num_gpus == 2 else []
    colocated = [*pool, *COLOCATED_FLAGS] + (["--decode", "2", "--decode-gpus", "0,1"] if num_gpus == 2 else [])
    tag = "moe-interference-2gpu" if num_gpus == 2 else "moe-interference"
    why = "two workers of all 48 (~61 GB of bf16 weights each) fit no single GPU" if num_gpus == 1 else "--moe-layers"
    setup = {
        "model": str(model), "num_hidden_layers": layers, "gpus": num_gpus, "gpu": gpu_name(),
        "command": shlex.join(sys.argv), "kv_pool_bytes_per_worker": MOE_KV_BYTES,
        "placement": "prefill GPU 0, decode GPU 1; colocated: a worker per GPU" if two else "one GPU, MPS 50/50",
        "layers_cut": f"{layers} of qwen3-30b-a3b's 48 layers: {why}" if layers < 48 else None,
    }  # fmt: skip
    (out / f"{tag}-setup.json").write_text(json.dumps(setup, indent=1))
    runs = [(f"{tag}-disagg", WITH_LONG), (f"{tag}-decode-only", DECODE_ONLY)]
    clusters = [("disagg", [*pool, *two], runs), ("colocated", colocated, [(f"{tag}-colocated", WITH_LONG)])]
    for label, flags, cluster_runs in clusters:
        with_cluster(model, out, f"{tag}-{label}", flags, cluster_runs)
        for name, _ in cluster_runs:
            path = out / f"{name}.json"
            path.write_text(json.dumps(json.loads(path.read_text()) | {"moe_setup": setup}, indent=1))


def part_throughput(model: Path, out: Path) -> None:
    """The random load with every request at once (the most each system sustains), disaggregated and colocated."""
    burst = [*RANDOM[: RANDOM.index("--request-rate")], "--num-prompts", "200", "--request-rate", "inf", *GOODPUT]
    burst += ["--client-processes", "4"]
    with_cluster(model, out, "disagg", WORKER_FLAGS, [("burst-disagg", burst)])
    with_cluster(model, out, "colocated", [*WORKER_FLAGS, *COLOCATED_FLAGS], [("burst-colocated", burst)])


FRONT_DOOR_STREAMS = (64, 256)
FRONT_ENDS = 4
"""The front-door part runs its loads again on a cluster of this many front ends (pdserve-cluster --frontends)."""


def part_frontdoor(model: Path, out: Path) -> None:
    """Issue 35: the 1B cluster at 64 and 256 concurrent streams (closed loop, 128 in / 256 out) through the gRPC
    and the HTTP door: output tok/s and TTFT, beside the decode worker's step time during the run (its own step
    rate allows streams / step time tokens per second); with one front end, then FRONT_ENDS."""
    runs = []
    for n in FRONT_DOOR_STREAMS:
        load = ["--dataset", "random", "--num-prompts", str(2 * n), "--input-len", "128", "--output-len", "256"]
        load += ["--request-rate", "inf", "--max-concurrency", str(n), "--client-processes", "4"]
        http = [*load, "--backend", "openai", "--model-dir", str(model)]
        runs += [(f"frontdoor-grpc-{n}", load), (f"frontdoor-openai-{n}", http)]
    # NOTE: a fixed pool: two workers sizing theirs from free memory at once once left decode graph capture OOM
    flags = [*WORKER_FLAGS, "--max-num-seqs", "256", "--num-blocks", "16384"]
    with_cluster(model, out, "frontdoor", flags, runs)
    spread = [(f"{name}-k{FRONT_ENDS}", [*args, "--grpc-channels", "16"]) for name, args in runs]
    with_cluster(model, out, f"frontdoor-k{FRONT_ENDS}", [*flags, "--frontends", str(FRONT_ENDS)], spread)


def part_colocated(model: Path, out: Path) -> None:
    runs = [
        ("interference-colocated", WITH_LONG),
        ("random-colocated", RANDOM),
    ]
    with_cluster(model, out, "colocated", [*WORKER_FLAGS, *COLOCATED_FLAGS], runs)
    argv = [sys.executable, str(ROOT / "scripts" / "bench_transformers_baseline.py"), "--model", str(model)]
    argv += ["--dummy", "--dtype", "bfloat16", "--device", DEVICE, "--batch-size", "32", "--save-detailed"]
    argv += ["--result-json", str(out / "random-transformers.json"), *RANDOM]
    argv = [a for a in argv if a not in ("--request-rate", "4")]  # NOTE: static batches: all at t=0
    print(f"== transformers: exit {subprocess.call(argv)}", flush=True)


COMMANDS = [
    f"python scripts/bench_serving_suite.py --part {part} --out RESULTS"
    for part in ("disagg", "colocated", "interference", "throughput", "routing", "conditional")
] + ["python scripts/bench_serving_suite.py --part summarize --results RESULTS --out bench/results/serving_h200"]
HEADLINE = {
    "interference": ("interference-disagg", "interference-decode-only", "interference-colocated"),
    "interference_2gpu": tuple(f"interference-2gpu-{k}" for k in ("disagg", "decode-only", "colocated")),
    "shared_prefix": tuple(f"shared-{c}-rate{r}" for c in ("cache", "nocache") for r in SHARED_RATES),
    "exact_hit": ("exact-hit",),
    "throughput": ("random-disagg", "random-colocated", "random-transformers", "burst-disagg", "burst-colocated"),
    "routing": tuple(f"routing-{load}-{p}" for load in ("shared", "burst") for p in ("prefix", "round_robin")),
    "conditional": ("conditional-on", "conditional-off"),
    "moe_interference": tuple(f"moe-interference-{k}" for k in ("disagg", "decode-only", "colocated")),
    "moe_interference_2gpu": tuple(f"moe-interference-2gpu-{k}" for k in ("disagg", "decode-only", "colocated")),
}
KEYS = ("completed", "failed", "median_ttft_ms", "p99_ttft_ms", "median_ttft_outside_ms", "median_tpot_ms",
        "median_itl_ms", "p99_itl_ms", "output_throughput", "request_goodput")  # fmt: skip


def gpu_name() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True)
        return out.stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return "unknown"


def summarize(results: Path, dest: Path, gpu: str) -> dict[str, Any]:
    """From the runs' detailed JSONs in `results`: dest/summary.json (headline numbers), each run's report
    without its per-request records, and PNGs of the interference and burst runs."""
    from pdserve.router.benchmark.metrics import record_from_json
    from pdserve.router.benchmark.plots import write_plots

    dest.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"gpu": gpu, "commands": COMMANDS, "runs": {}}
    for group, names in HEADLINE.items():
        for name in names:
            path = results / f"{name}.json"
            if not path.exists():
                continue
            report = json.loads(path.read_text())
            tag = "short" if "interference" in group else None
            metrics = report["metrics_by_tag"][tag] if tag else report["metrics"]
            row = {k: metrics.get(k) for k in KEYS} | {"worker_step_ms": report.get("worker_step_ms")}
            if group in ("routing", "conditional"):
                hit = metrics["total_cached_tokens"] / max(1, metrics["total_input_tokens"])
                row |= {"cache_hit_token_ratio": hit, "prefill_forward_calls": report.get("prefill_forward_calls")}
                row |= {"decode_prefill_tokens": report.get("decode_prefill_tokens")}
            summary["runs"].setdefault(group, {})[name] = row
            requests = report.pop("requests", [])
            (dest / path.name).write_text(json.dumps(report, indent=1))
            if name.startswith(("interference", "moe-interference", "burst")) and requests:
                write_plots([record_from_json(r) for r in requests], dest / f"{name}-plots")
    (dest / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [
        "disagg",
        "shared",
        "colocated",
        "interference",
        "throughput",
        "routing",
        "conditional",
        "two_gpus",
        "exact",
        "frontdoor",
        "moe_interference",
    ]
    names.append("summarize")
    p.add_argument("--part", choices=names, required=True)
    p.add_argument("--results", default=None, help="summarize: the folder of the runs' JSON files")
    p.add_argument("--gpu", default=None, help="summarize: the GPU the runs had (default: each report's)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="bench model folder (default: a Llama-1B shape made here)")
    p.add_argument("--moe-gpus", type=int, choices=(1, 2), default=1, help="moe_interference: GPUs of the cluster")
    p.add_argument(
        "--moe-layers", type=int, default=None,
        help=f"moe_interference: layers of qwen3-30b-a3b kept (default {MOE_LAYERS} on one GPU, all 48 on two)",
    )  # fmt: skip
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part == "summarize":
        print(json.dumps(summarize(Path(args.results), out, args.gpu or "see each report"), indent=1))
        return 0
    if args.part == "moe_interference":
        layers = args.moe_layers or (MOE_LAYERS if args.moe_gpus == 1 else 48)
        part_moe_interference(Path(args.model) if args.model else moe_model(layers), out, args.moe_gpus)
        return 0
    model = Path(args.model) if args.model else Path(os.environ.get("TMPDIR", "/tmp")) / "pdserve-llama-1b"
    if not args.model:
        from make_bench_model import write_bench_model

        write_bench_model("llama-1b", model)
    parts = {
        "disagg": part_disagg,
        "colocated": part_colocated,
        "interference": part_interference,
        "throughput": part_throughput,
        "routing": part_routing,
        "shared": part_shared,
        "conditional": part_conditional,
        "two_gpus": part_two_gpus,
        "exact": part_exact,
        "frontdoor": part_frontdoor,
    }
    parts[args.part](model, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
