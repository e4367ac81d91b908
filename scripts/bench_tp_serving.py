#!/usr/bin/env python3
"""A model larger than one GPU served disaggregated with a TP-2 group per role, against colocated TP-2 groups on
the same GPUs, dummy bf16 weights:

- 2 GPUs (--gpus 2): Qwen2.5-32B's shape (64 GB, 32.8 GB per GPU and group); 1 prefill (TP 2) + 1 decode (TP 2)
  sharing GPUs 0,1 under a 50/50 MPS split, against one colocated TP-2 worker on GPUs 0,1.
- 4 GPUs (--gpus 4): Llama-3-70B's shape (141 GB, 70.6 GB per GPU and group; --shape qwen2.5-32b where a GPU
  has less than ~100 GB); prefill TP 2 on GPUs 0,1 + decode TP 2 on GPUs 2,3, against two colocated TP-2
  workers (0,1 and 2,3); and a "whole" part: one TP-4 group over the four GPUs, the reference of the tokens.

Each part measures the batch-1 TPOT against the HBM floor of one group's per-GPU weight bytes, runs
bench_serving_suite's long-prompt interference load scaled to fit a ~3.5-minute part, and asks a few short
prompts for greedy tokens with their log-probabilities: every part's tokens are compared with the reference
(the TP-4 group on 4 GPUs, colocated TP 2 on 2) as vLLM compares bf16 runs: equal up to the first position where
each run's token is among the other's top log-probabilities, and the chosen tokens' log-probabilities within
LOGPROB_TOLERANCE before it.

    python3 scripts/bench_tp_serving.py --part all --out bench/out/tp32b                   # 2 GPUs, ~7 minutes
    python3 scripts/bench_tp_serving.py --gpus 4 --part all --out bench/out/tp70b          # 4 GPUs, ~8 minutes
    python3 scripts/bench_tp_serving.py --smoke --part all --out /tmp/tp-smoke             # tiny qwen2 on CPU (gloo)
    python3 scripts/bench_tp_serving.py --gpus 4 --part model                              # the model's figures

Parts: disagg, colocated, whole (4 GPUs), all (in that order; each cluster stopped before the next starts).
Before any cluster, the GPU's bandwidth is measured in a child process (a device-to-device copy on GPU 0, CUDA
events): the floor is one group's per-GPU weight bytes over it. Writes --out/{part}.json (GPU, torch, every
command, every figure, the bench reports; for a failed part the tails of its logs) and --out/summary.json;
scratch (model folder, run dirs, logs) lives in a temp dir, removed at the end. Past --deadline-s the run stops
its cluster, writes what it has and exits 1.

NOTE: NVLink multicast stays off in everything started here (MULTICAST_OFF): on a shared host a program using it
can take the GPUs out of service.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np
from bench_serving_suite import COLOCATED_FLAGS, INTERFERENCE, gpu_name

from pdserve.core.model_store import GPT2_VOCAB_SIZE, write_gpt2_tokenizer
from pdserve.core.step_timer import quantile_ms
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
QWEN2: dict[str, Any] = dict(
    model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False
)
QWEN25_32B: dict[str, Any] = dict(
    QWEN2, hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
    intermediate_size=27648, vocab_size=152064, rope_theta=1e6, max_position_embeddings=32768,
)  # fmt: skip
LLAMA3_70B: dict[str, Any] = dict(
    model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_size=8192,
    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
    vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
)  # fmt: skip
SHAPES = {"qwen2.5-32b": QWEN25_32B, "llama-70b": LLAMA3_70B}
LARGE_GPU_BYTES = 100 << 30
"""GPU memory from which --shape auto picks the 70B shape on 4 GPUs (an H200's 141 GB; not an H100's 80)."""
TINY_QWEN2: dict[str, Any] = dict(
    QWEN2, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=1024, rope_theta=1e6, max_position_embeddings=1024,
)  # fmt: skip
PARTS = ("disagg", "colocated", "whole")
"""whole: one group of every GPU, run on 4 GPUs only (on 2 it is the colocated part)."""
EQUALITY_PROMPTS = 4
EQUALITY_TOKENS = 32
TOP_LOGPROBS = 5
LOGPROB_TOLERANCE = 0.1
"""Nats between two bf16 runs' log-probabilities of the same greedy token (different TP sizes sum partial
products in different orders)."""
STOP_RESERVE_S = 30.0
"""Seconds of --deadline-s kept for stopping the last cluster and writing the JSON."""
STOP_TIMEOUT_S = 60.0
"""Seconds the launcher gets to stop its cluster after SIGTERM (router grace, workers, MPS)."""
TAIL_LINES = 40
READY = "pdserve cluster ready on "
"""The launcher's ready line, before the router's address."""
OUT_OF_MEMORY = ("out of memory", "OutOfMemoryError")
"""Worker log lines that end a part at once: the supervisor would restart the worker into the same shortage."""

BATCH1 = ["--dataset", "random", "--num-prompts", "4", "--input-len", "128", "--output-len", "256"]
BATCH1 += ["--max-concurrency", "1", "--seed", "1"]
"""One stream at a time, 128-token prompts, 256 tokens out, four of them."""
WARMUP = ["--dataset", "random", "--num-prompts", "8", "--input-len", "8:4000", "--output-len", "4:8"]
"""First prefills of each shape compile kernels: 8 prompts of up to 4000 tokens at once (~1000 of the 2048 KV
blocks)."""
LOADED = [*INTERFERENCE, "--long-rate", "1", "--duration", "20"]
"""bench_serving_suite's interference load (64 short streams x 256 tokens, 4000-token prompts) at 1 long prompt
a second for 20 s: a 32B 4000-token prefill takes ~0.4 s under a 50% SM share, so 2/s would saturate it."""
SMOKE_BATCH1 = ["--dataset", "random", "--num-prompts", "2", "--input-len", "128", "--output-len", "16"]
SMOKE_BATCH1 += ["--max-concurrency", "1", "--seed", "1"]
SMOKE_WARMUP = ["--dataset", "random", "--num-prompts", "4", "--input-len", "8:256", "--output-len", "2:4"]
SMOKE_LOADED = ["--dataset", "long-prompt", "--num-short", "4", "--short-output-len", "16", "--long-input-len", "256"]
SMOKE_LOADED += ["--long-output-len", "4", "--long-rate", "2", "--duration", "4", "--client-processes", "1"]


@dataclass(frozen=True)
class Setup:
    """Where and at which sizes the parts run: the GPU figure, or --smoke's tiny CPU run of the same flow."""

    device: str
    """cuda (NCCL, MPS) or cpu (gloo)."""
    dtype: str
    """Weights and activations."""
    model: dict[str, Any]
    """config.json fields of the model (dummy weights)."""
    num_gpus: int
    """GPUs of every part (0 on CPU: ranks over gloo)."""
    num_blocks: int
    """KV blocks of each worker (each rank holds its KV heads' share of each block)."""
    max_num_seqs: int
    """Sequences a worker runs at once: the 64 short streams and the long prompts decoding beside them."""
    warmup: list[str]
    batch1: list[str]
    loaded: list[str]
    """bench_serving.py arguments of the warm-up, batch-1 and interference loads."""
    start_timeout_s: float
    """How long a cluster may take to become ready (dummy weights, CUDA graph capture)."""
    load_timeout_s: float
    """How long one load may take."""
    copy_bytes: int
    """Bytes of the bandwidth measurement's copy; 0: not measured."""
    tp: int = 2

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]

    @property
    def groups(self) -> int:
        """TP groups the GPUs hold side by side (1 on CPU or 2 GPUs: the roles share them)."""
        return max(1, self.num_gpus // self.tp)

    @property
    def parts(self) -> list[str]:
        return list(PARTS) if self.groups > 1 else [p for p in PARTS if p != "whole"]


def gpu_setup(num_gpus: int, shape: str) -> Setup:
    """The GPU figure on 2 or 4 GPUs; shape auto: the 70B on 4 GPUs of >= LARGE_GPU_BYTES, else the 32B."""
    if shape == "auto":
        shape = (
            "llama-70b" if num_gpus == 4 and min(gpu_memory_bytes(), default=0) >= LARGE_GPU_BYTES else "qwen2.5-32b"
        )
    return Setup("cuda", "bfloat16", SHAPES[shape], num_gpus, 2048, 80, WARMUP, BATCH1, LOADED, 360.0, 180.0, 4 << 30)


SMOKE = Setup("cpu", "float32", TINY_QWEN2, 0, 256, 16, SMOKE_WARMUP, SMOKE_BATCH1, SMOKE_LOADED, 240.0, 120.0, 0)


class PartFailed(RuntimeError):
    """A part cannot go on (a cluster that did not start, a load without a result)."""


class DeadlineExceeded(PartFailed):
    """--deadline-s passed."""


class Deadline:
    """The script's end: work stops STOP_RESERVE_S before it, so the last cluster can stop in time."""

    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.end = self.start + seconds - STOP_RESERVE_S

    def limit(self, seconds: float) -> float:
        """seconds, or less where the deadline comes first; DeadlineExceeded when it has passed."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("deadline passed")
        return min(seconds, left)

    def passed(self) -> bool:
        return time.monotonic() >= self.end

    def elapsed(self) -> float:
        return time.monotonic() - self.start


# --- the model ---------------------------------------------------------------------------------------------------


def num_params(m: dict[str, Any]) -> int:
    """Parameters of a qwen2 (q/k/v bias) or llama (no bias) model: no o bias, RMSNorm weights, untied lm_head
    unless tied."""
    hidden, heads, kv_heads = m["hidden_size"], m["num_attention_heads"], m["num_key_value_heads"]
    head_dim = hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    bias = (q + 2 * kv) if m["model_type"] == "qwen2" else 0
    attention = hidden * (q + 2 * kv) + bias + q * hidden
    mlp = 3 * hidden * m["intermediate_size"]
    layer = attention + mlp + 2 * hidden
    embeddings = m["vocab_size"] * hidden * (1 if m["tie_word_embeddings"] else 2)
    return m["num_hidden_layers"] * layer + embeddings + hidden


def model_figures(setup: Setup) -> dict[str, Any]:
    """The config and its weight bytes; one group's per-GPU share is params / TP x dtype bytes."""
    params = num_params(setup.model)
    per_gpu = params * setup.dtype_bytes // setup.tp
    return {"config": setup.model, "num_params": params, "dtype": setup.dtype, "tp": setup.tp,
            "weight_bytes_per_gpu": per_gpu, "weight_bytes_total": params * setup.dtype_bytes}  # fmt: skip


def write_model(setup: Setup, out: Path) -> Path:
    """config.json of the setup's model plus GPT-2's tokenizer (cut to the vocabulary when smaller); its last id
    is eos. Prompts are token ids: ids past the tokenizer's detokenize to empty text."""
    from transformers import AutoConfig

    spec = dict(setup.model)
    tokenizer_vocab = min(spec["vocab_size"], GPT2_VOCAB_SIZE)
    spec |= {"bos_token_id": tokenizer_vocab - 1, "eos_token_id": tokenizer_vocab - 1}
    out.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(spec.pop("model_type"), **spec).save_pretrained(out)
    write_gpt2_tokenizer(out, tokenizer_vocab)
    return out


# --- the HBM floor -----------------------------------------------------------------------------------------------


def copy_bandwidth(num_bytes: int, repeats: int = 20) -> dict[str, Any]:
    """GPU 0's memory bandwidth: dst.copy_(src) of num_bytes, timed by CUDA events; read + written bytes over
    the median and the fastest copy. Runs in a child process: its CUDA context is gone before a cluster starts."""
    import torch

    src = torch.ones(num_bytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    moved, median = 2 * num_bytes, statistics.median(seconds)
    return {"device_name": torch.cuda.get_device_name(0), "copy_bytes": num_bytes, "repeats": repeats,
            "median_s": median, "min_s": min(seconds), "median_gb_s": moved / median / 1e9,
            "max_gb_s": moved / min(seconds) / 1e9}  # fmt: skip


def measure_bandwidth(setup: Setup, deadline: Deadline) -> dict[str, Any] | None:
    """copy_bandwidth in a spawned child; None without a measurement (--smoke), {"error": ...} if it failed."""
    if not setup.copy_bytes:
        return None
    ctx = multiprocessing.get_context("spawn")
    try:
        with ctx.Pool(1) as pool:
            result: dict[str, Any] = pool.apply_async(copy_bandwidth, (setup.copy_bytes,)).get(deadline.limit(120.0))
            return result
    except Exception as exc:  # NOTE: the parts run without a floor rather than not at all
        return {"error": f"{type(exc).__name__}: {exc}"}


def hbm_floor(model: dict[str, Any], bandwidth: dict[str, Any] | None) -> dict[str, Any]:
    """One group's per-GPU weight bytes over the fastest measured copy: the least a batch-1 decode step reads."""
    rate = (bandwidth or {}).get("max_gb_s")
    floor = model["weight_bytes_per_gpu"] / (rate * 1e9) * 1e3 if rate else None
    return {"bandwidth": bandwidth, "weight_bytes_per_gpu": model["weight_bytes_per_gpu"], "floor_ms": floor}


# --- a cluster and its loads ---------------------------------------------------------------------------------------


def cluster_flags(setup: Setup, part: str) -> list[str]:
    """The launcher's flags of a part past --model, --run-dir and --port. disagg: the prefill group on the first
    TP GPUs, the decode group on the next (on the same ones where there are only TP GPUs: MPS); colocated: one
    TP group per TP GPUs; whole: one group of every GPU."""
    flags = ["--device", setup.device, "--dtype", setup.dtype, "--load-format", "dummy", "--metrics-port", "0"]
    flags += ["--num-blocks", str(setup.num_blocks), "--max-num-seqs", str(setup.max_num_seqs)]
    gpus = [str(i) for i in range(setup.num_gpus)]
    tp = str(setup.tp)
    if part == "disagg":
        flags += ["--prefill-tp", tp, "--decode-tp", tp]
        prefill, decode = gpus[: setup.tp], gpus[-setup.tp :]
        return flags + (["--prefill-gpus", ",".join(prefill), "--decode-gpus", ",".join(decode)] if gpus else [])
    groups, tp = (1, str(max(setup.num_gpus, setup.tp))) if part == "whole" else (setup.groups, tp)
    flags += [*COLOCATED_FLAGS, "--decode", str(groups), "--tp", tp]
    return flags + (["--decode-gpus", ",".join(gpus)] if gpus else [])


class Cluster:
    """pdserve-cluster in the background on a free port, its output in a log file."""

    def __init__(self, argv: list[str], run_dir: Path, log: Path) -> None:
        self.argv, self.run_dir, self.log = argv, run_dir, log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, deadline: Deadline, timeout: float) -> str:
        """The router's address once the launcher says the cluster is ready; PartFailed with the logs if it
        exits or takes longer than timeout, DeadlineExceeded at the deadline."""
        end = time.monotonic() + deadline.limit(timeout)
        while time.monotonic() < end:
            if address := self.address():
                return address
            if self.proc.poll() is not None:
                raise PartFailed(f"the launcher exited ({self.proc.returncode}) before the cluster was ready")
            if oom := self.out_of_memory():
                raise PartFailed(f"a worker ran out of memory while starting: {oom}")
            time.sleep(0.5)
        if deadline.passed():
            raise DeadlineExceeded("deadline passed while the cluster started")
        raise PartFailed(f"cluster not ready in {timeout:.0f} s")

    def address(self) -> str | None:
        """host:port from the launcher's ready line (None before it)."""
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith(READY):
                return line.removeprefix(READY).split()[0]
        return None

    def decode_counters(self) -> dict[str, int]:
        """decode-0's latest heartbeat counters (its step-interval histogram among them)."""
        time.sleep(0.6)  # NOTE: two heartbeat intervals, so the snapshot covers the run's last steps
        stats = json.loads((self.run_dir / "stats" / "decode-0.json").read_text())
        return stats["counters"]  # type: ignore[no-any-return]

    def out_of_memory(self) -> str | None:
        """The first out-of-memory line of a worker's log, if any."""
        for log in sorted((self.run_dir / "logs").glob("*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if any(mark in line for mark in OUT_OF_MEMORY):
                    return f"{log.name}: {line.strip()}"
        return None

    def mps_on(self) -> bool:
        return "pdserve: MPS on" in self.log.read_text(errors="replace")

    def log_tails(self) -> dict[str, list[str]]:
        """The last lines of the launcher's log and of every worker's and the router's."""
        logs = [self.log, *sorted((self.run_dir / "logs").glob("*.log"))]
        return {log.name: tail(log) for log in logs}

    def stop(self) -> None:
        """SIGTERM to the launcher (it stops the router, the workers and MPS), then wait."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print("== the launcher did not stop; killed (its workers may be left)", flush=True)
            self.proc.kill()
            self.proc.wait()


def tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


class Load(NamedTuple):
    """One bench_serving.py run: its command line, exit code, seconds and JSON report (no per-request records)."""

    command: str
    exit_code: int
    seconds: float
    report: dict[str, Any]


def run_load(address: str, name: str, args: list[str], scratch: Path, timeout: float, deadline: Deadline) -> Load:
    """bench_serving.py against address in its own process group, killed past its time."""
    path, log = scratch / f"{name}.json", scratch / f"{name}.log"
    argv = [sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--address", address, "--no-progress"]
    argv += ["--result-json", str(path), *args]
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(deadline.limit(timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # NOTE: the load's client processes with it
        proc.wait()
        kind = DeadlineExceeded if deadline.passed() else PartFailed
        raise kind(f"{name}: no result in {time.monotonic() - started:.0f} s") from None
    if not path.exists():
        raise PartFailed(f"{name}: exit {code}, no result: " + " | ".join(tail(log, 10)))
    seconds = time.monotonic() - started
    print(f"== {name}: exit {code}, {seconds:.1f} s", flush=True)
    return Load(shlex.join(argv), code, seconds, json.loads(path.read_text()))


def equality_prompts(setup: Setup) -> list[list[int]]:
    """Short prompts of random token ids (the same in every part), below the tokenizer's eos id."""
    rng = np.random.default_rng(7)
    high = min(setup.model["vocab_size"], GPT2_VOCAB_SIZE) - 1
    return [rng.integers(0, high, n).tolist() for n in (8, 16, 31, 40)[:EQUALITY_PROMPTS]]


def greedy_logprobs(address: str, prompts: list[list[int]], timeout: float) -> list[dict[str, Any]]:
    """Each prompt's greedy tokens, one stream at a time, with each token's log-probability and the top ones."""
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=EQUALITY_TOKENS, ignore_eos=True, logprobs=True,
                                 top_logprobs=TOP_LOGPROBS)  # fmt: skip
    runs = []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for prompt in prompts:
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
            tokens: list[int] = []
            logprobs: list[float] = []
            top: list[list[list[float]]] = []
            for response in stub.Generate(request, timeout=timeout):
                tokens += response.token_ids
                logprobs += [lp.logprob for lp in response.logprobs]
                top += [[[t.token_id, t.logprob] for t in lp.top] for lp in response.logprobs]
            runs.append({"prompt_len": len(prompt), "token_ids": tokens, "logprobs": logprobs, "top": top})
    return runs


def compare_greedy(got: list[dict[str, Any]], ref: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's comparison of two bf16 runs: tokens equal up to the first difference, where each run's token must be
    among the other's top log-probabilities (a near tie; the runs part there); before it, the chosen tokens'
    log-probabilities within LOGPROB_TOLERANCE."""
    rows = []
    for g, r in zip(got, ref, strict=True):
        equal, close, diffs = 0, True, []
        for i, (a, b) in enumerate(zip(g["token_ids"], r["token_ids"], strict=True)):
            if a != b:
                close = b in [t for t, _ in g["top"][i]] and a in [t for t, _ in r["top"][i]]
                break
            equal += 1
            diffs.append(abs(g["logprobs"][i] - r["logprobs"][i]))
        worst = max(diffs, default=0.0)
        rows.append({"equal_tokens": equal, "tokens": len(r["token_ids"]), "near_tie_at_difference": close,
                     "max_logprob_diff": worst, "within_tolerance": close and worst <= LOGPROB_TOLERANCE})  # fmt: skip
    return {"prompts": rows, "identical": all(r["equal_tokens"] == r["tokens"] for r in rows),
            "within_tolerance": all(r["within_tolerance"] for r in rows), "tolerance": LOGPROB_TOLERANCE}  # fmt: skip


def greedy_vs_reference(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every part's greedy tokens against the reference part's (whole where it ran, else colocated)."""
    have = {part: r["greedy"] for part, r in results.items() if r.get("greedy")}
    reference = "whole" if "whole" in have else "colocated"
    if reference not in have:
        return {"reference": reference, "error": "the reference part has no greedy tokens"}
    compared = {part: compare_greedy(g, have[reference]) for part, g in have.items() if part != reference}
    return {"reference": reference, **compared}


# --- figures -----------------------------------------------------------------------------------------------------

STREAM_KEYS = ("completed", "failed", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
               "median_ttft_ms", "p99_ttft_ms", "output_throughput")  # fmt: skip
LONG_KEYS = ("completed", "failed", "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms")


def pick(metrics: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: metrics.get(k) for k in keys}


def batch1_figures(report: dict[str, Any], floor_ms: float | None) -> dict[str, Any]:
    """TPOT of one stream at a time, and its ratio to the HBM floor."""
    figures = pick(report["metrics"], STREAM_KEYS)
    tpot = figures["median_tpot_ms"]
    return figures | {"tpot_over_floor": tpot / floor_ms if floor_ms and tpot else None}


def interference_figures(report: dict[str, Any], before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """The short streams' TPOT / ITL, the long prompts' TTFT, and decode-0's step intervals over the run (bucket
    upper bounds: the ITL at the engine)."""
    tags = report["metrics_by_tag"]
    steps = {f"p{int(q * 100)}": quantile_ms(before, after, q) for q in (0.5, 0.9, 0.99)}
    return {
        "short": pick(tags.get("short", {}), STREAM_KEYS),
        "long": pick(tags.get("long", {}), LONG_KEYS),
        "worker_step_ms": {k: "inf" if v == float("inf") else v for k, v in steps.items()},
    }


# --- a part --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Context:
    """What every part shares: the setup, the model folder, scratch, the deadline and the run's figures."""

    setup: Setup
    model_dir: Path
    scratch: Path
    deadline: Deadline
    header: dict[str, Any]
    """GPU, torch, the script's command, the model and the HBM floor: the head of every JSON written."""


def run_part(ctx: Context, part: str) -> dict[str, Any]:
    """Start the part's cluster, run its loads, stop it; the part's JSON (with "error" and the log tails when it
    could not finish)."""
    run_dir = ctx.scratch / f"run-{part}"
    argv = [sys.executable, "-m", "pdserve.router.cluster_cli", "--model", str(ctx.model_dir)]
    argv += ["--run-dir", str(run_dir), "--port", "0", *cluster_flags(ctx.setup, part)]
    result: dict[str, Any] = {"part": part, **ctx.header, "cluster": {"command": shlex.join(argv)}, "loads": {}}
    result |= {"error": None}
    print(f"== {part}: {shlex.join(argv)}", flush=True)
    cluster = Cluster(argv, run_dir, ctx.scratch / f"cluster-{part}.log")
    try:
        measure_part(ctx, cluster, result)
    except PartFailed as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"== {part} failed: {exc}", flush=True)
    finally:
        cluster.stop()
    if result["error"] is not None:  # NOTE: after the stop: the launcher has quoted its children's last lines
        result["log_tails"] = cluster.log_tails()
    return result


def measure_part(ctx: Context, cluster: Cluster, result: dict[str, Any]) -> None:
    """Fills result: readiness, the warm-up, batch-1 TPOT against the floor, the interference load."""
    setup, started = ctx.setup, time.monotonic()
    address = cluster.wait_ready(ctx.deadline, setup.start_timeout_s)
    result["cluster"] |= {"ready_s": time.monotonic() - started, "mps": cluster.mps_on()}
    print(f"== cluster ready on {address} in {result['cluster']['ready_s']:.1f} s", flush=True)
    reports = result.setdefault("reports", {})

    def load(name: str, args: list[str]) -> dict[str, Any]:
        run = run_load(address, f"{result['part']}-{name}", args, ctx.scratch, setup.load_timeout_s, ctx.deadline)
        result["loads"][name] = {"command": run.command, "exit_code": run.exit_code, "seconds": run.seconds}
        reports[name] = run.report
        return run.report

    try:
        result["greedy"] = greedy_logprobs(address, equality_prompts(setup), ctx.deadline.limit(setup.load_timeout_s))
    except grpc.RpcError as exc:  # NOTE: a stream that ran out of the time left ends the part, not the run
        kind = DeadlineExceeded if ctx.deadline.passed() else PartFailed
        raise kind(f"greedy streams: {type(exc).__name__}: {str(exc)[:300]}") from None
    if result["part"] == "whole":
        return  # NOTE: the reference of the tokens only
    load("warmup", setup.warmup)
    result["batch1"] = batch1_figures(load("batch1", setup.batch1), ctx.header["hbm"]["floor_ms"])
    before = cluster.decode_counters()
    report = load("interference", setup.loaded)
    result["interference"] = interference_figures(report, before, cluster.decode_counters())


# --- the run -------------------------------------------------------------------------------------------------------


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """A part's figures for summary.json."""
    batch1, loaded = result.get("batch1", {}), result.get("interference", {})
    short, long = loaded.get("short", {}), loaded.get("long", {})
    return {
        "batch1_median_tpot_ms": batch1.get("median_tpot_ms"),
        "batch1_tpot_over_floor": batch1.get("tpot_over_floor"),
        **{f"short_{k}": short.get(k) for k in ("median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")},
        **{f"long_{k}": long.get(k) for k in ("median_ttft_ms", "p99_ttft_ms", "completed")},
        "worker_step_ms": loaded.get("worker_step_ms"),
        "ready_s": result.get("cluster", {}).get("ready_s"),
        "error": result.get("error"),
    }


def write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=1, default=str) + "\n")


def earlier_results(out: Path, parts: list[str]) -> dict[str, dict[str, Any]]:
    """The JSONs an earlier run left in out of the parts this one does not run: their figures stay in the summary
    and their greedy tokens are compared (a part run alone on a later call)."""
    paths = {part: out / f"{part}.json" for part in PARTS if part not in parts}
    return {part: json.loads(path.read_text()) for part, path in paths.items() if path.exists()}


def run_parts(ctx: Context, parts: list[str], out: Path) -> bool:
    """Each part in turn, its JSON and the summary written after each; whether all of them finished."""
    summary: dict[str, Any] = {**ctx.header, "complete": False, "parts": {}}
    results = earlier_results(out, parts)
    for part, result in results.items():
        summary["parts"][part] = headline(result) | {"earlier_run": result.get("date")}
    for part in parts:
        if ctx.deadline.passed():
            summary["parts"][part] = {"error": "DeadlineExceeded: not started"}
            continue
        results[part] = result = run_part(ctx, part)
        write_json(out / f"{part}.json", result)
        summary["parts"][part] = headline(result)
        summary["greedy_vs_reference"] = greedy_vs_reference(results)
        summary["elapsed_s"] = ctx.deadline.elapsed()
        write_json(out / "summary.json", summary)
    summary["complete"] = all(p.get("error") is None for p in summary["parts"].values())
    summary["elapsed_s"] = ctx.deadline.elapsed()
    write_json(out / "summary.json", summary)
    print(json.dumps(summary["parts"], indent=1), flush=True)
    return bool(summary["complete"])


def gpu_memory_bytes() -> list[int]:
    """Total memory of every GPU nvidia-smi lists ([] without one)."""
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(line) << 20 for line in out.split()]


def host_gpus() -> list[str]:
    """Name and total memory of every GPU nvidia-smi lists ([] without one)."""
    query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
    try:
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return []


def make_header(setup: Setup, hbm: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    bandwidth = hbm["bandwidth"] or {}
    gpu = gpu_name() if setup.device == "cuda" else "cpu"
    return {
        "gpu": bandwidth.get("device_name", gpu) if gpu == "unknown" else gpu,
        "gpus": host_gpus() if setup.device == "cuda" else [],
        "torch": version("torch"),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python3", "scripts/bench_tp_serving.py", *argv]),
        "env": MULTICAST_OFF,
        "device": setup.device,
        "model": model_figures(setup),
        "hbm": hbm,
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=[*PARTS, "all", "model"], required=True, help="model: print its figures")
    p.add_argument("--out", default=None, help="folder of the JSON files (3 at most)")
    p.add_argument("--smoke", action="store_true", help="tiny qwen2 on CPU (gloo), tiny loads, no bandwidth")
    p.add_argument("--gpus", type=int, choices=[2, 4], default=2, help="GPUs of the host (default 2)")
    p.add_argument("--shape", choices=["auto", *SHAPES], default="auto",
                   help="the model (auto: llama-70b on 4 GPUs of >= 100 GB, else qwen2.5-32b)")  # fmt: skip
    p.add_argument("--deadline-s", type=float, default=540.0, help="stop, write what there is and exit 1 after this")
    args = p.parse_args(argv)
    if args.part != "model" and args.out is None:
        p.error(f"--part {args.part} needs --out")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.environ.update(MULTICAST_OFF)  # NOTE: before any process (or CUDA context) exists
    setup = SMOKE if args.smoke else gpu_setup(args.gpus, args.shape)
    if args.part == "model":
        print(json.dumps(model_figures(setup), indent=1))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = Deadline(args.deadline_s)
    scratch = Path(tempfile.mkdtemp(prefix="pdserve-tp-"))
    try:
        model_dir = write_model(setup, scratch / "model")
        hbm = hbm_floor(model_figures(setup), measure_bandwidth(setup, deadline))
        print(f"== HBM floor {hbm['floor_ms']} ms; bandwidth {hbm['bandwidth']}", flush=True)
        ctx = Context(setup, model_dir, scratch, deadline, make_header(setup, hbm, argv))
        complete = run_parts(ctx, setup.parts if args.part == "all" else [args.part], out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # NOTE: what a failure needs is in the JSON (log tails)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
