"""`pdserve-bench-serving`: benchmark a running pdserve router the way vLLM's benchmark_serving does.

    pdserve-bench-serving --dataset random --num-prompts 200 --input-len 512:1024 --output-len 128 \\
        --request-rate 8 --result-json bench/results/serving.json --plot bench/results/serving
    pdserve-bench-serving --dataset shared-prefix --num-groups 8 --prefix-len 900 --suffix-len 100 --output-len 30
    pdserve-bench-serving --dataset long-prompt --num-short 16 --long-rate 0.5 --duration 60
    pdserve-bench-serving --dataset duplicate --model-dir models/smollm2 --num-groups 16 --copies 4
    pdserve-bench-serving --backend openai --address 127.0.0.1:8000 --model-dir models/smollm2 --num-prompts 200

--backend openai streams POST /v1/completions (server-sent events) instead of the gRPC Generate call; the model's
vocabulary and name then come from --model-dir.

A goodput sweep (sweep_run.py) runs one rate after another against the same cluster, each for --warmup + --duration
seconds of Poisson arrivals, and reports goodput, SLO attainment and the knee; it runs for the datasets of published
length distributions (lengths.py), a JSONL of real lengths, or --dataset random with several rates, --rate-search or
--duration:

    pdserve-bench-serving --dataset chat --request-rate 2,4,8 --duration 60 --warmup 10 --goodput ttft:1000 tpot:15 \
        --num-gpus 2 --layout 1P:1D --result-json bench/out/chat-1p1d.json
    pdserve-bench-serving --dataset jsonl --dataset-path lengths.jsonl --rate-search 1,16,4 --goodput itl_p99:50
    pdserve-bench-serving --plot bench/out/plots --plot-from bench/out/chat-*.json    # one line per layout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.router.benchmark import datasets as ds
from pdserve.router.benchmark.lengths import WORKLOADS, LengthSampler, UniformWorkload, workload_named
from pdserve.router.benchmark.metrics import RequestRecord, build_report, format_table, parse_goodput, parse_percentiles
from pdserve.router.benchmark.run_config import RunConfig
from pdserve.router.benchmark.runner import fetch_model_info, run_in_processes
from pdserve.router.benchmark.sweep import DEFAULT_TARGET, RateSearch, Window, parse_rates
from pdserve.router.benchmark.sweep_plots import load_sweeps, write_sweep_plots
from pdserve.router.benchmark.sweep_run import SweepConfig, print_sweep, rate_path, rate_report, run_sweep, sweep_report
from pdserve.router.client_auth import add_client_args, client_auth
from pdserve.router.model_info import ModelSpec
from pdserve.router.tokenizer import RouterTokenizer

SAMPLED = (*WORKLOADS, "jsonl")
"""Datasets whose lengths come from a distribution (lengths.py); they always run as a sweep."""
DATASETS = ("random", "shared-prefix", "long-prompt", "duplicate", *SAMPLED)
DEFAULT_OUTPUT_LEN = {"random": "128", "shared-prefix": "30", "duplicate": "128"}
DATASET_ARGS = {
    "random": ("num_prompts", "input_len", "output_len"),
    "shared-prefix": ("num_prompts", "num_groups", "prefix_len", "suffix_len", "output_len"),
    "long-prompt": ("num_short", "short_input_len", "short_output_len", "long_input_len", "long_output_len",
                    "long_rate", "duration"),
    "duplicate": ("num_groups", "copies", "num_words", "output_len", "model_dir"),
    **{name: ("dataset_path",) for name in SAMPLED},
}  # fmt: skip
ARRIVAL_ARGS = ("request_rate", "burstiness", "max_concurrency", "seed")
SWEEP_ARGS = ("request_rates", "rate_search", "warmup", "duration", "drain_timeout", "slo_target", "num_gpus", "layout")
BACKENDS = ("grpc", "openai")


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """Flags shared with scripts/bench_transformers_baseline.py (random and shared-prefix)."""
    p.add_argument("--num-prompts", type=int, default=100, help="requests (random, shared-prefix)")
    p.add_argument("--input-len", default="1024", help="prompt tokens, N or MIN:MAX (random)")
    p.add_argument("--output-len", default=None, help="output tokens, N or MIN:MAX (default 128; shared-prefix 30)")
    p.add_argument("--num-groups", type=int, default=8, help="prefix groups / distinct texts")
    p.add_argument("--prefix-len", type=int, default=900, help="tokens shared by a group (shared-prefix)")
    p.add_argument("--suffix-len", type=int, default=100, help="tokens unique to a request (shared-prefix)")
    p.add_argument("--seed", type=int, default=0)


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    """The goodput sweep's flags (sweep_run.py)."""
    p.add_argument("--dataset-path", default=None, help='jsonl: one {"input_len": N, "output_len": M} a line')
    p.add_argument("--warmup", type=float, default=10.0, help="sweep: seconds of each rate left out before its window")
    p.add_argument(
        "--drain-timeout", type=float, default=60.0,
        help="sweep: seconds after the window a request may still run; then it is cut off and counts as failed",
    )  # fmt: skip
    p.add_argument("--rate-search", default=None, metavar="LO,HI,STEPS", help="sweep: bisect the knee in [LO, HI]")
    p.add_argument("--slo-target", type=float, default=DEFAULT_TARGET, help="sweep: attainment of the knee")
    p.add_argument("--num-gpus", type=int, default=1, help="sweep: GPUs of the cluster (per-GPU figures)")
    p.add_argument("--layout", default="", help="sweep: the cluster's layout, a label (e.g. colocated-c2048, 1P:1D)")
    p.add_argument("--plot-from", nargs="+", default=None, metavar="JSON", help="only plot these sweeps into --plot")


def check_sweep_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Parse the rate list and the search; decide whether this run is a sweep (args.sweep)."""
    try:
        args.request_rates = parse_rates(args.request_rate)
        args.search = RateSearch.parse(args.rate_search) if args.rate_search else None
    except ValueError as exc:
        p.error(str(exc))
    args.request_rate = args.request_rates[0]
    several = len(args.request_rates) > 1 or args.search is not None
    random_sweep = args.dataset == "random" and (several or args.duration is not None)
    args.sweep = args.dataset in SAMPLED or random_sweep
    if args.plot_from is not None:
        if not args.plot:
            p.error("--plot-from needs --plot DIR")
        return
    if several and not args.sweep:
        p.error(f"--dataset {args.dataset} runs one rate: a sweep takes random or {', '.join(SAMPLED)}")
    if args.sweep and any(math.isinf(r) for r in args.request_rates) and args.search is None:
        p.error("a sweep needs finite --request-rate values (or --rate-search)")
    if args.search is not None and args.request_rate == math.inf:
        args.request_rates = []  # NOTE: the default rate (inf) is not a sweep point
    if args.dataset == "jsonl" and not args.dataset_path:
        p.error("--dataset jsonl needs --dataset-path")
    if args.duration is None:
        args.duration = 60.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve-bench-serving", description="Serving benchmark of a pdserve router.")
    p.add_argument("--address", default="127.0.0.1:50051", help="router host:port (openai: or http://host:port)")
    p.add_argument("--backend", choices=BACKENDS, default="grpc", help="gRPC Generate or OpenAI /v1/completions")
    p.add_argument("--served-model-name", default=None, help="openai: the requests' model (default: --model-dir name)")
    p.add_argument("--dataset", choices=DATASETS, default="random")
    add_dataset_args(p)
    p.add_argument("--num-short", type=int, default=8, help="concurrent short streams (long-prompt)")
    p.add_argument("--short-input-len", type=int, default=32)
    p.add_argument("--short-output-len", type=int, default=256)
    p.add_argument("--long-input-len", type=int, default=4000)
    p.add_argument("--long-output-len", type=int, default=16)
    p.add_argument("--long-rate", type=float, default=0.5, help="long prompts per second, Poisson (long-prompt)")
    p.add_argument(
        "--duration", type=float, default=None,
        help="seconds: of the long-prompt run (default 60); of each sweep rate's measured window (default 60)",
    )  # fmt: skip
    p.add_argument("--copies", type=int, default=2, help="requests per text (duplicate)")
    p.add_argument("--num-words", default="64:128", help="words per text, N or MIN:MAX (duplicate)")
    p.add_argument("--model-dir", default=None, help="model folder (duplicate: its tokenizer; openai: its config)")
    p.add_argument(
        "--request-rate", default="inf",
        help="req/s; inf sends all at once; a list (2,4,8) runs a goodput sweep, one rate after another",
    )  # fmt: skip
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="open-loop requests in flight at most")
    p.add_argument("--client-processes", type=int, default=1, help="split the load over this many client processes")
    p.add_argument(
        "--grpc-channels", type=int, default=1,
        help="gRPC connections per client process (the kernel spreads connections, not calls, over the front ends "
        "of pdserve-cluster --frontends K)",
    )  # fmt: skip
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--percentiles", default="50,90,95,99", help="comma-separated, e.g. 50,90,99.9")
    p.add_argument(
        "--goodput", nargs="+", default=[], metavar="KIND:MS",
        help="SLOs, KIND in ttft, tpot, e2el, itl_p99 (a request's own p99 ITL); good = meets every one",
    )  # fmt: skip
    p.add_argument("--result-json", default=None, help="write the results here")
    p.add_argument("--save-detailed", action="store_true", help="per-request records in the JSON")
    p.add_argument(
        "--plot", default=None, metavar="DIR",
        help="write ttft_cdf/itl_cdf/latency_over_time PNGs (a sweep: attainment and goodput per GPU vs rate)",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the router")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    add_sweep_args(p)
    add_client_args(p)
    args = p.parse_args(argv)
    if args.output_len is None:
        args.output_len = DEFAULT_OUTPUT_LEN.get(args.dataset, "128")
    check_sweep_args(p, args)
    if args.dataset == "duplicate" and not args.model_dir:
        p.error("--dataset duplicate needs --model-dir (the tokenizer)")
    if args.backend == "openai" and not args.model_dir:
        p.error("--backend openai needs --model-dir (the vocabulary and the model's name)")
    return args


def build_specs(args: argparse.Namespace, vocab: ds.VocabInfo) -> list[ds.RequestSpec]:
    """The random or shared-prefix requests (no start times)."""
    output_len = ds.parse_range(args.output_len)
    if args.dataset == "random":
        return ds.random_dataset(vocab, args.num_prompts, ds.parse_range(args.input_len), output_len, args.seed)
    if args.dataset == "shared-prefix":
        return ds.shared_prefix_dataset(
            vocab, args.num_prompts, args.num_groups, args.prefix_len, args.suffix_len, output_len, args.seed
        )
    raise ValueError(f"no static specs for {args.dataset}")


def build_workload(args: argparse.Namespace, vocab: ds.VocabInfo) -> ds.Workload:
    """The dataset named by --dataset, open-loop requests scheduled by --request-rate/--burstiness."""
    if args.dataset == "long-prompt":
        short = (args.short_input_len, args.short_output_len)
        long = (args.long_input_len, args.long_output_len)
        duration = 60.0 if args.duration is None else args.duration
        return ds.long_prompt_workload(vocab, args.num_short, short, long, args.long_rate, duration, args.seed)
    if args.dataset == "duplicate":
        tokenizer = RouterTokenizer.from_dir(args.model_dir)
        specs = ds.duplicate_dataset(
            tokenizer, vocab.vocab_size, args.num_groups, args.copies, ds.parse_range(args.num_words),
            ds.parse_range(args.output_len), args.seed,
        )  # fmt: skip
    else:
        specs = build_specs(args, vocab)
    return ds.schedule(specs, args.request_rate, args.burstiness, args.seed)


def model_from_dir(model_dir: str) -> pb.ModelInfo:
    """What GetModelInfo would say, read from the model folder (the OpenAI door has no such call)."""
    spec = ModelSpec.from_dir(model_dir)
    return pb.ModelInfo(
        model_name=spec.name, vocab_size=spec.vocab_size, max_model_len=spec.max_model_len,
        eos_token_ids=spec.eos_token_ids,
    )  # fmt: skip


def model_json(info: pb.ModelInfo) -> dict[str, Any]:
    block = info.block_size if info.HasField("block_size") else None
    return {
        "model_name": info.model_name,
        "vocab_size": info.vocab_size,
        "max_model_len": info.max_model_len,
        "block_size": block,
        "eos_token_ids": list(info.eos_token_ids),
    }


def run_config_json(args: argparse.Namespace, argv: Sequence[str], backend: str, model: dict[str, Any]) -> dict:
    """The "config" section of the result JSON."""
    dataset = {name: getattr(args, name) for name in DATASET_ARGS.get(args.dataset, ())}
    return {
        "backend": backend,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv),
        "address": getattr(args, "address", None),
        "dataset": {"name": args.dataset, **dataset},
        "arrivals": {name: getattr(args, name, None) for name in ARRIVAL_ARGS},
        "sampling": {"ignore_eos": getattr(args, "ignore_eos", True), "temperature": getattr(args, "temperature", 0.0)},
        "model": model,
    }


def _strict(obj: Any) -> Any:
    """inf/nan floats (e.g. --request-rate inf) as strings, so the file stays strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_strict(v) for v in obj]
    return obj


def write_json(report: dict[str, Any], path: str | Path) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_strict(report), indent=2, allow_nan=False, default=str) + "\n")


def print_report(report: dict[str, Any], percentiles: Sequence[float]) -> None:
    print(format_table(report["metrics"], percentiles))
    tags = report["metrics_by_tag"]
    if len(tags) > 1:
        for tag, metrics in tags.items():
            print(format_table(metrics, percentiles, title=f"tag: {tag}"))


def sweep_main(
    args: argparse.Namespace, run_json: dict[str, Any], vocab: ds.VocabInfo, max_model_len: int, config: RunConfig,
    percentiles: Sequence[float], slos: dict[str, float],
) -> int:  # fmt: skip
    """The goodput sweep: each rate's JSON as it finishes, then the summary (and its plots); 1 when a rate
    completed no request at all."""
    if args.dataset in SAMPLED:
        sampler: LengthSampler = workload_named(args.dataset, args.dataset_path)
    else:
        sampler = UniformWorkload(ds.parse_range(args.input_len), ds.parse_range(args.output_len))
    window = Window(args.warmup, args.duration)
    sweep = SweepConfig(
        tuple(args.request_rates), args.search, window, args.drain_timeout, slos, args.num_gpus, args.layout,
        args.slo_target, tuple(percentiles),
    )  # fmt: skip
    run_json["lengths"] = {
        "name": sampler.name, "source": sampler.source, "mean_input_len": sampler.mean_input_len,
        "mean_output_len": sampler.mean_output_len, "max_model_len": max_model_len,
    }  # fmt: skip
    run_json["sweep"] = {k: getattr(args, k) for k in SWEEP_ARGS}

    def workload_at(rate: float) -> ds.Workload:
        return ds.sampled_workload(vocab, sampler, rate, window.end_s, max_model_len, args.seed)

    def on_rate(result: dict[str, Any], records: list[RequestRecord]) -> None:
        print(f"rate {result['request_rate']:g} req/s: {result['num_requests']} sent, attainment "
              f"{result['slo_attainment']:.1%}, goodput {result['goodput']:.3f} req/s", flush=True)  # fmt: skip
        if args.result_json:
            report = rate_report(run_json, result, records, sweep, args.save_detailed)
            write_json(report, rate_path(args.result_json, result["request_rate"]))

    results = run_sweep(workload_at, config, args.client_processes, sweep, on_rate)
    report = sweep_report(run_json, results, sweep)
    print_sweep(report)
    if args.result_json:
        write_json(report, args.result_json)
    if args.plot:
        write_sweep_plots([report["sweep"]], args.plot)
    return 0 if all(r["metrics"]["completed"] for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.plot_from is not None:
        write_sweep_plots(load_sweeps(args.plot_from), args.plot)
        return 0
    percentiles, slos = parse_percentiles(args.percentiles), parse_goodput(args.goodput)
    if args.backend == "openai":
        info = model_from_dir(args.model_dir)
    else:
        info = asyncio.run(fetch_model_info(args.address, args.timeout, client_auth(args)))
    vocab = ds.VocabInfo(info.vocab_size, tuple(info.eos_token_ids))
    config = RunConfig(
        args.address, args.max_concurrency, args.ignore_eos, args.temperature, args.timeout, not args.no_progress,
        args.backend, args.served_model_name or info.model_name, client_auth(args), grpc_channels=args.grpc_channels,
    )  # fmt: skip
    backend = "pdserve" if args.backend == "grpc" else "pdserve-openai"
    run_json = run_config_json(args, argv, backend, model_json(info))
    if args.sweep:
        return sweep_main(args, run_json, vocab, info.max_model_len, config, percentiles, slos)
    records = run_in_processes(build_workload(args, vocab), config, args.client_processes)
    report = build_report(run_json, records, percentiles, slos, args.save_detailed)
    print_report(report, percentiles)
    if args.result_json:
        write_json(report, args.result_json)
    if args.plot:
        from pdserve.router.benchmark.plots import write_plots  # NOTE: matplotlib is optional (the `bench` extra).

        write_plots(records, args.plot)
    return 0 if report["metrics"]["failed"] == 0 else 1
