#!/usr/bin/env python3
"""The goodput table (issues 37, 39): for each workload and SLO, the measured goodput per GPU of every layout the
planner compares on N GPUs, beside the planner's prediction, its error and its choice, and the ratio of the best
disaggregated layout to the best colocated. Filled over as many calls as it takes (each at most --deadline-s):

    python scripts/bench_goodput.py --profile P.json --gpus 2 --out bench/out/goodput-2gpu        # each call
    python scripts/bench_goodput.py --profile P.json --gpus 2 --out bench/out/goodput-2gpu --report
    python scripts/bench_goodput.py --smoke --profile /tmp/profile.json --out /tmp/goodput-smoke    # CPU

Per layout: one cluster start (pdserve-cluster with the planner's Layout.cluster_flags, dummy weights), a warm-up
load, then per workload one goodput sweep (pdserve-bench-serving --save-detailed, one invocation per rate), rescored
under every SLO (router/benchmark/rescore.py). A (layout, workload) pair is done when its summary
sweeps/LAYOUT/WORKLOAD.json says so: a later call skips it, and measures no rate whose JSON is there. A pair
whose planned rates do not fit before the deadline is left for a later call.

Rates: from 0.7x the lowest to 1.3x the highest knee the planner predicts for the layout and workload under the
SLOs (whole-layout req/s; SLOs it predicts no knee for left out), geometrically spaced at most 1.6x apart, 3 to 5
of them (Setup.num_rates), rounded to 3 significant digits; the lowest sends at least Setup.min_window_requests in
the window. Where the planner predicts no knee for the layout, the best layout's knee stands in. After they are
measured, while the highest rate still meets some SLO (at 90% attainment) one rate 1.6x above it is added, else
while the lowest misses an SLO the planner predicts a knee for, one 1.6x below it, else while some SLO's knee lies
between two rates more than 1.3x apart, their geometric middle (the widest first); Setup.max_extra_rates in all.
A rate measured by an earlier call whose detailed JSON is not in --out counts as its rescored summaries scored it
(goodput_table.kept_runs), so --out without the rate files, as committed, goes on where it stopped.

KV pools: each worker sizes its own from free memory, as profile_layout.py's engine did; in a layout with a shared
GPU every worker gets a fixed pool of the planner's KV capacity for the decode worker there (half the profile's):
two workers sizing theirs from free memory at once can run the GPU out of memory.

Writes --out/run.json (settings, every call's command and profile), plans/ (the planner's JSON per workload and SLO,
cached per profile),
sweeps/LAYOUT/ (per workload: each rate's detailed JSON, the summary, one rescored summary per SLO; logs),
table.json, table.md and plots/WORKLOAD.SLO/*.png. Every file names the GPU and the commands that made it (a plot:
its folder's table). Past --deadline-s the run stops
its cluster, writes the table from what there is and exits 1; it exits 1 whenever the table is incomplete.

NOTE: NVLink multicast stays off in everything started here (bench_tp_serving.MULTICAST_OFF).

--lanes K measures K layouts at once on a host of K x --gpus GPUs (goodput_lanes.py): on 4 GPUs the 2-GPU table
takes half the device time. --frontends K starts each cluster with K router processes on one fixed port: one streams
~13k responses/s (docs/deployment.md), which a chat workload's ~200-token streams reach near 65 req/s. A table's
setting: a table measured with one front end goes on with one.

A device call (carry .whl, the profile and --out without its *.rate-*.json; the tool sends at most 64 MiB and
returns at most 8 files of 16 MiB, and one call's --out came to 20 MB gzipped): after the run,

    cd bench/out && tar cJf - --exclude='*.rate-*.json' goodput-2gpu | split -b 15m -d - $OUT/goodput.tar.xz. &&
    find goodput-2gpu -name '*.rate-*.json' | tar cJf - -T - | split -b 15m -d - $OUT/rates.tar.xz.

and here `cat goodput.tar.xz.* | tar xJf - -C bench/out; cat rates.tar.xz.* | tar xJf - -C bench/out-rates`: the
rate files are needed only to rescore under another SLO (copy them in first). The 2-GPU table so far is committed
without them: bench/results/goodput_2gpu_h200 (--out for the calls that go on with it).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import goodput_lanes
from bench_frontend import free_port
from bench_serving_suite import WARMUP, gpu_name
from bench_tp_serving import (
    MULTICAST_OFF,
    SMOKE_WARMUP,
    STOP_RESERVE_S,
    Cluster,
    Deadline,
    DeadlineExceeded,
    PartFailed,
    host_gpus,
    run_load,
    write_json,
)
from goodput_table import (
    build_table,
    kept_runs,
    layout_tag,
    merge_rates,
    pair_dir,
    predicted,
    read_json,
    remaining_pairs,
    scored_rates,
    summary_path,
    table_md,
    write_plots,
)

from pdserve.router.benchmark.rescore import rescore
from pdserve.router.benchmark.sweep_run import rate_path
from pdserve.router.plan import cli as plan_cli
from pdserve.router.plan.layouts import Layout, layouts_for
from pdserve.router.plan.profile import Profile

DEFAULT_SLOS = ("ttft:2000,tpot:50", "ttft:1500,tpot:25", "ttft:1000,tpot:15", "ttft:1000,itl_p99:10")
"""Loose, in between and tight (issue 37), and smooth streaming: every request's own p99 gap between tokens within
10 ms, which a decode step that carries a prefill chunk breaks."""
WORKLOADS = ("chat", "long-input", "long-context")
SMOKE_LAYOUTS = ("colocated-c512", "1P:1D")
RATE_SPAN = (0.7, 1.3)
"""The rates run from this multiple of the lowest predicted knee to this multiple of the highest."""
RATE_STEP = 1.6
"""Largest ratio of two neighbouring rates, and of an added rate to the one it extends."""
BRACKET_RATIO = 1.3
"""A knee bracketed by rates farther apart than this gets a rate between them (narrow_rate), budget permitting."""
RATE_OVERHEAD_S = 15.0
"""Seconds a rate takes beyond warm-up + window (+ drain, at most): the client's start, the cool-down, requests
finishing after the window."""
BLOCK_SIZE = 16
"""pdserve-cluster's KV block size (its default)."""


@dataclass(frozen=True)
class Setup:
    """Where the clusters run and how long each rate is measured: the GPU table or --smoke's CPU run."""

    device: str
    """cuda or cpu."""
    dtype: str
    """Weights and activations."""
    tiny: bool
    """Llama-3-8B's shape cut to bench_moe.TINY's sizes (--smoke), else the whole shape."""
    num_blocks: int | None
    """KV blocks of every worker; None: as the module docstring says."""
    max_num_seqs: int
    """Sequences a worker runs at once, in the clusters and the planner."""
    warmup_load: tuple[str, ...]
    """pdserve-bench-serving arguments of the load run once per cluster start (first shapes compile kernels)."""
    client_processes: int
    """pdserve-bench-serving --client-processes."""
    start_timeout_s: float
    """How long a cluster may take to become ready."""
    start_estimate_s: float
    """What a cluster start and its warm-up load take: a layout is not started with less time left."""
    warmup_s: float
    duration_s: float
    drain_s: float
    """Each rate's --warmup, --duration and --drain-timeout."""
    num_rates: tuple[int, int]
    """Fewest and most rates planned per pair."""
    max_extra_rates: int
    """Rates added per pair where the planned ones do not bracket a knee, or bracket one too widely."""
    min_window_requests: int
    """The lowest rate sends at least this many requests in the window."""

    @property
    def rate_s(self) -> float:
        """What a rate takes, as planned (a rate is not started with less than its drain more left)."""
        return self.warmup_s + self.duration_s + RATE_OVERHEAD_S

    @property
    def min_rate(self) -> float:
        return self.min_window_requests / self.duration_s


GPU = Setup("cuda", "bfloat16", False, None, 128, tuple(WARMUP), 4, 300.0, 120.0, 10.0, 20.0, 30.0, (3, 5), 4, 20)
SMOKE = Setup("cpu", "float32", True, 256, 16, tuple(SMOKE_WARMUP), 1, 120.0, 20.0, 1.0, 3.0, 20.0, (2, 2), 0, 4)


def slo_tag(slo: dict[str, float]) -> str:
    """{"ttft": 2000, "tpot": 50} -> ttft2000-tpot50, {"itl_p99": 10} -> itl_p99_10 (file names)."""
    return "-".join(f"{k}{'_' if k[-1].isdigit() else ''}{v:g}" for k, v in slo.items())


def goodput_flags(slo: dict[str, float]) -> list[str]:
    return [f"{k}:{v:g}" for k, v in slo.items()]


def round_rate(rate: float) -> float:
    return float(f"{rate:.3g}")


# --- rates ---------------------------------------------------------------------------------------------------------


def choose_rates(knees: Sequence[float], setup: Setup) -> list[float]:
    """The planned rates of a pair from its predicted knees (req/s, > 0), as the module docstring says."""
    lo = max(RATE_SPAN[0] * min(knees), setup.min_rate)
    hi = max(RATE_SPAN[1] * max(knees), lo * RATE_STEP)
    fewest, most = setup.num_rates
    n = min(max(math.ceil(math.log(hi / lo) / math.log(RATE_STEP)) + 1, fewest), most)
    return [round_rate(lo * (hi / lo) ** (i / (n - 1))) for i in range(n)]


def extra_rate(sweeps: Sequence[dict[str, Any]], knees: Sequence[float], planned: Sequence[float],
               setup: Setup) -> float | None:  # fmt: skip
    """The next rate where the measured ones do not bracket the knees, else one inside the widest bracket
    (narrow_rate), or None. sweeps: the pair's summary rescored under each SLO ("rates" rows with
    "slo_attainment"); knees: the planner's knee under each (0: none)."""
    measured = [row["request_rate"] for row in sweeps[0]["rates"]]
    if len([r for r in measured if r not in planned]) >= setup.max_extra_rates:
        return None
    target = sweeps[0]["target_attainment"]
    if any(s["rates"][-1]["slo_attainment"] >= target for s in sweeps):
        return round_rate(measured[-1] * RATE_STEP)
    missed = any(s["rates"][0]["slo_attainment"] < target for s, k in zip(sweeps, knees, strict=True) if k > 0)
    if missed and measured[0] / RATE_STEP >= setup.min_rate:
        return round_rate(measured[0] / RATE_STEP)
    return narrow_rate(sweeps, measured)


def narrow_rate(sweeps: Sequence[dict[str, Any]], measured: Sequence[float]) -> float | None:
    """The geometric middle of the widest knee bracket (an SLO's highest rate met and the next rate measured, which
    missed) that is wider than BRACKET_RATIO, or None: the knee lies anywhere in its bracket, so a bracket of 2x
    would make any prediction within 2x look right."""
    brackets = []
    for s in sweeps:
        met = [r["request_rate"] for r in s["rates"] if r["slo_attainment"] >= s["target_attainment"]]
        above = [r for r in measured if met and r > max(met)]
        if above and min(above) / max(met) > BRACKET_RATIO:
            brackets.append((min(above) / max(met), max(met), min(above)))
    if not brackets:
        return None
    _, low, high = max(brackets)
    rate = round_rate(math.sqrt(low * high))
    return rate if low < rate < high else None


# --- the planner -----------------------------------------------------------------------------------------------------


def plan_argv(profile: str, workload: str, slo: dict[str, float], gpus: int, setup: Setup) -> list[str]:
    slo_text = ",".join(goodput_flags(slo))
    return ["--profile", profile, "--workload", workload, "--slo", slo_text, "--gpus", str(gpus),
            "--max-num-seqs", str(setup.max_num_seqs), "--warmup-s", f"{setup.warmup_s:g}",
            "--duration-s", f"{setup.duration_s:g}", "--json"]  # fmt: skip


def load_plan(out: Path, argv: list[str], header: dict[str, Any]) -> dict[str, Any]:
    """pdserve-plan's JSON for argv, cached in out/plans for the profile it was planned from (the planner is seeded:
    a later call with that profile gets the same)."""
    workload, slo = argv[argv.index("--workload") + 1], argv[argv.index("--slo") + 1]
    path = out / "plans" / f"{workload}.{slo_tag(plan_cli.parse_slo(slo))}.json"
    cached = read_json(path)
    if cached is not None and cached.get("profile_sha256") == header["profile_sha256"]:
        return cached
    doc = plan_cli.plan(plan_cli.build_parser().parse_args(argv))
    doc |= {"gpu": header["gpu"], "command": shlex.join(["pdserve-plan", *argv]),
            "profile_sha256": header["profile_sha256"]}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, doc)
    return doc


def predicted_knees(plans: dict[str, dict[str, Any]], layout: str) -> list[float]:
    """The layout's predicted knee (req/s) under each SLO, from the plans of one workload by SLO tag."""
    return [predicted(plan, layout)["goodput"] for plan in plans.values()]


def pair_rates(plans: dict[str, dict[str, Any]], layout: str, setup: Setup) -> list[float]:
    """choose_rates of the layout's predicted knees; where it has none, of the best layout's; where no layout has
    one, from the lowest rate."""
    knees = [k for k in predicted_knees(plans, layout) if k > 0]
    best = max(row["goodput"] for plan in plans.values() for row in plan["layouts"])
    return choose_rates(knees or [best or setup.min_rate / RATE_SPAN[0]], setup)


# --- measuring -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Context:
    """What every layout's run shares."""

    setup: Setup
    out: Path
    profile: Profile
    model_dir: Path
    scratch: Path
    deadline: Deadline
    slos: dict[str, dict[str, float]]
    """SLOs by tag, in table order."""
    plans: dict[str, dict[str, dict[str, Any]]]
    """The planner's JSON by workload, then SLO tag."""
    header: dict[str, Any]
    """GPU, date, this call's command."""
    lane_gpus: tuple[str, ...] = ()
    """A lane's GPUs by UUID (goodput_lanes.py); () outside lanes: the layouts' GPU indices as they are."""
    frontends: int = 1
    """Router processes of each cluster (--frontends): one streams ~13k responses/s (docs/deployment.md)."""


def shared_pool_blocks(profile: Profile, layout: Layout) -> int | None:
    """KV blocks of every worker of a layout with a shared GPU: the planner's pool of the decode worker there (its
    kv_share of the profile's capacity at its TP size); None for any other layout or without a capacity."""
    capacity = profile.at_tp(layout.decode_tp).kv_capacity_tokens
    if layout.mps_split is None or capacity is None:
        return None
    return int(capacity * layout.decode[0].kv_share) // BLOCK_SIZE


def cluster_argv(ctx: Context, layout: Layout, run_dir: Path) -> list[str]:
    setup = ctx.setup
    argv = [sys.executable, "-m", "pdserve.router.cluster_cli", "--model", str(ctx.model_dir), "--run-dir"]
    port = str(free_port()) if ctx.frontends > 1 else "0"  # NOTE: several front ends share one fixed port
    argv += [str(run_dir), "--port", port, "--device", setup.device, "--dtype", setup.dtype, "--load-format", "dummy"]
    argv += ["--frontends", str(ctx.frontends)] if ctx.frontends > 1 else []
    flags = layout.cluster_flags(setup.max_num_seqs)
    argv += ["--metrics-port", "0", *(goodput_lanes.lane_flags(flags, ctx.lane_gpus) if ctx.lane_gpus else flags)]
    blocks = setup.num_blocks or shared_pool_blocks(ctx.profile, layout)
    return argv + (["--num-blocks", str(blocks)] if blocks else [])


def has_time(ctx: Context, seconds: float, what: str) -> bool:
    """Whether `seconds` are left before the deadline (if not, says so)."""
    if ctx.deadline.end - time.monotonic() >= seconds:
        return True
    print(f"== {what} needs {seconds:.0f} s: left for a later call", flush=True)
    return False


def require_time(ctx: Context, seconds: float, what: str) -> None:
    """DeadlineExceeded unless `seconds` are left before the deadline."""
    if not has_time(ctx, seconds, what):
        raise DeadlineExceeded(f"{what} not started")


def run_layout(ctx: Context, layout: Layout, workloads: list[str]) -> None:
    """Start the layout's cluster, measure each workload's pair, stop it; error.json when it could not run."""
    setup = ctx.setup
    require_time(ctx, setup.start_estimate_s + setup.rate_s + setup.drain_s, f"{layout.name}'s cluster")
    folder = pair_dir(ctx.out, layout.name)
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    run_dir = ctx.scratch / layout_tag(layout.name)
    argv = cluster_argv(ctx, layout, run_dir)
    print(f"== {layout.name}: {shlex.join(argv)}", flush=True)
    cluster = Cluster(argv, run_dir, folder / "logs" / "cluster.log")
    try:
        address = cluster.wait_ready(ctx.deadline, setup.start_timeout_s)
        warmup = run_load(address, "warmup", list(setup.warmup_load), folder / "logs", 600.0, ctx.deadline)
        write_json(folder / "logs" / "warmup.json", warmup.report | {"gpu": ctx.header["gpu"]})
        commands = [shlex.join(argv), warmup.command]
        for workload in workloads:
            measure_pair(ctx, layout, workload, address, commands)
        (folder / "error.json").unlink(missing_ok=True)
    except DeadlineExceeded:
        raise
    except PartFailed as exc:
        error = {"error": f"{type(exc).__name__}: {exc}", "cluster": shlex.join(argv), "log_tails": cluster.log_tails()}
        write_json(folder / "error.json", {**ctx.header, **error})
        print(f"== {layout.name} failed: {exc}", flush=True)
    finally:
        cluster.stop()


def measure_pair(ctx: Context, layout: Layout, workload: str, address: str, commands: list[str]) -> None:
    """The pair's planned rates (none unless all fit before the deadline), then the extra ones (extra_rate), each
    rescored; its summary marked complete."""
    plans, setup, out = ctx.plans[workload], ctx.setup, ctx.out
    planned, knees = pair_rates(plans, layout.name, setup), predicted_knees(plans, layout.name)
    loosest = list(ctx.slos)[knees.index(max(knees))]
    todo = [rate for rate in planned if rate not in scored_rates(out, layout.name, workload)]
    if not has_time(ctx, len(todo) * setup.rate_s + setup.drain_s, f"{layout.name} {workload} ({len(todo)} rates)"):
        return
    earlier = (read_json(summary_path(out, layout.name, workload)) or {}).get("bench_goodput", {})
    cluster, commands = commands[0], [*earlier.get("commands", []), *commands]

    def measure(rate: float) -> None:
        commands.append(measure_rate(ctx, layout, workload, rate, ctx.slos[loosest], address, cluster))

    for rate in todo:
        measure(rate)
    while True:
        rescored = rescore_pair(ctx, layout, workload, loosest, commands)
        nxt = extra_rate([doc["sweep"] for doc in rescored.values()], knees, planned, setup)
        if nxt is None:
            break
        measure(nxt)
    doc = json.loads(summary_path(out, layout.name, workload).read_text())
    doc["bench_goodput"] |= {"complete": True, "planned_rates": planned}
    write_json(summary_path(out, layout.name, workload), doc)


def measure_rate(
    ctx: Context, layout: Layout, workload: str, rate: float, slo: dict[str, float], address: str, cluster: str
) -> str:
    """One pdserve-bench-serving rate into the pair's folder (its JSON names the GPU and the cluster); its command."""
    setup, folder = ctx.setup, pair_dir(ctx.out, layout.name)
    require_time(ctx, setup.rate_s + setup.drain_s, f"{layout.name} {workload} at {rate:g} req/s")
    args = ["--dataset", workload, "--request-rate", f"{rate:g}", "--warmup", f"{setup.warmup_s:g}"]
    args += ["--duration", f"{setup.duration_s:g}", "--drain-timeout", f"{setup.drain_s:g}", "--save-detailed"]
    args += ["--goodput", *goodput_flags(slo), "--num-gpus", str(layout.num_gpus), "--layout", layout.name]
    args += ["--client-processes", str(setup.client_processes)]
    load = run_load(address, workload, args, folder, setup.rate_s + setup.drain_s + 60.0, ctx.deadline)
    path = rate_path(summary_path(ctx.out, layout.name, workload), rate)
    doc = read_json(path)
    if doc is None or "requests" not in doc:
        raise PartFailed(f"{layout.name} {workload} at {rate:g} req/s: exit {load.exit_code}, no result")
    write_json(path, doc | {"gpu": ctx.header["gpu"], "cluster_command": cluster})
    return load.command


def rescore_pair(ctx: Context, layout: Layout, workload: str, loosest: str, commands: list[str]) -> dict[str, Any]:
    """The pair's summary (scored under the loosest SLO) and one rescored summary per SLO, written; the latter."""
    path = summary_path(ctx.out, layout.name, workload)
    kept = {tag: kept_runs(ctx.out, layout.name, workload, tag) for tag in ctx.slos}  # NOTE: before rewriting
    header = {**ctx.header, "commands": commands, "complete": False}
    summ = merge_rates(ctx.out, layout, workload, ctx.slos[loosest], kept[loosest])
    write_json(path, summ | {"bench_goodput": header})
    rescored = {}
    for tag, slo in ctx.slos.items():
        dest = path.with_name(f"{workload}.{tag}.json")
        argv = ["python", "-m", "pdserve.router.benchmark.rescore", str(path), "--goodput", *goodput_flags(slo)]
        command = shlex.join([*argv, "--out", str(dest)])
        doc = rescore(path, slo, kept[tag])
        rescored[tag] = doc | {"bench_goodput": {**ctx.header, "commands": [*commands, command]}}
        write_json(dest, rescored[tag])
    return rescored


# --- the run ---------------------------------------------------------------------------------------------------------


def write_model(setup: Setup, out: Path) -> Path:
    """Llama-3-8B's config.json (--smoke: cut to bench_moe.TINY's sizes) with GPT-2's tokenizer: dummy weights."""
    from bench_moe import TINY
    from bench_moe import write_model as write_config

    from pdserve.core.model_store import GPT2_VOCAB_SIZE, write_gpt2_tokenizer

    overrides = dict(TINY) if setup.tiny else {}
    write_config("llama-8b", out, overrides)
    return write_gpt2_tokenizer(out, min(overrides.get("vocab_size", GPT2_VOCAB_SIZE), GPT2_VOCAB_SIZE))


def record_call(out: Path, settings: dict[str, Any], header: dict[str, Any], check: bool) -> None:
    """Append this call to out/run.json; ValueError where out holds a table of other settings (when check)."""
    run = read_json(out / "run.json") or {"settings": settings, "invocations": []}
    if check and run["settings"] != settings:
        raise ValueError(f"{out} holds a table of other settings: {run['settings']} (this call: {settings})")
    run["invocations"].append(header)
    write_json(out / "run.json", run)


def call_settings(args: argparse.Namespace, setup: Setup, num_gpus: int, slos: dict[str, Any]) -> dict[str, Any]:
    """What every call filling one --out must share (run.json): what a rate's figures depend on. The profile only
    plans which rates to measure and predicts: each call records its own (call_header)."""
    return {"num_gpus": num_gpus, "model": args.model or ("tiny" if setup.tiny else "llama-8b"), "device": setup.device,
            "max_num_seqs": setup.max_num_seqs, "warmup_s": setup.warmup_s, "duration_s": setup.duration_s,
            "drain_s": setup.drain_s, "slos": slos,
            **({"frontends": args.frontends} if args.frontends > 1 else {})}  # fmt: skip


def call_header(setup: Setup, argv: list[str], profile: str) -> dict[str, Any]:
    """This call's GPU, date, command and profile: the head of every file it writes."""
    cuda = setup.device == "cuda"
    return {"gpu": gpu_name() if cuda else "cpu", "gpus": host_gpus() if cuda else [],
            "profile_sha256": hashlib.sha256(Path(profile).read_bytes()).hexdigest(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python3", "scripts/bench_goodput.py", *argv]), "env": MULTICAST_OFF}  # fmt: skip


def run_pairs(ctx: Context, layouts: list[Layout], pairs: list[tuple[str, str]]) -> None:
    """The pairs, one cluster per layout; stops at the deadline."""
    by_name = {layout.name: layout for layout in layouts}
    try:
        for name in dict.fromkeys(name for name, _ in pairs):
            run_layout(ctx, by_name[name], [w for layout, w in pairs if layout == name])
    except DeadlineExceeded as exc:
        print(f"== stopped: {exc}", flush=True)


def run_in_lanes(
    argv: list[str],
    setup: Setup,
    plans: dict[str, dict[str, dict[str, Any]]],
    layouts: list[Layout],
    pairs: list[tuple[str, str]],
    deadline: Deadline,
    gpus: list[list[str]],
    out: Path,
) -> None:
    """The pairs' layouts split among lanes (goodput_lanes.py) by their planned seconds, one child a lane."""
    seconds = {x.name: setup.start_estimate_s for x in layouts if any(name == x.name for name, _ in pairs)}
    for name, workload in pairs:
        seconds[name] += len(pair_rates(plans[workload], name, setup)) * setup.rate_s
    groups = goodput_lanes.split(seconds, len(gpus))
    left = deadline.end - time.monotonic() + STOP_RESERVE_S
    argvs = [goodput_lanes.child_argv(__file__, argv, g, lane, left) for g, lane in zip(groups, gpus, strict=False)]
    goodput_lanes.run_lanes(argvs, gpus[: len(groups)], out / "logs", left)


def host_problem(args: argparse.Namespace, setup: Setup, profile: Profile, num_gpus: int) -> str | None:
    """Why this host cannot measure the table (too few GPUs, not the profile's GPU), or None."""
    if setup.device != "cuda" or args.report:
        return None
    if len(host_gpus()) < num_gpus:
        return f"needs {num_gpus} GPUs, nvidia-smi lists {host_gpus()} (--smoke runs on CPU)"
    if gpu_name() != profile.gpu:
        return (
            f"{args.profile} profiles {profile.gpu}, this host has {gpu_name()}: profile this GPU first "
            "(scripts/profile_layout.py)"
        )
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="the planner's profile of this GPU (scripts/profile_layout.py)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to lay out (default: the profile's)")
    p.add_argument("--workloads", default=None, help=f"comma list (default {','.join(WORKLOADS)}; --smoke: chat)")
    p.add_argument("--slos", nargs="+", default=list(DEFAULT_SLOS), metavar="KIND:MS,KIND:MS", help="SLOs")
    p.add_argument("--layouts", default=None, help="comma list of layout names (default: every one the planner has)")
    p.add_argument("--out", required=True, help="the table's folder: a later call with it goes on where this stops")
    p.add_argument("--deadline-s", type=float, default=540.0, help="stop, write the table and exit 1 after this")
    p.add_argument("--model", default=None, help="model folder (default: Llama-3-8B's shape made here)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of each rate before its window")
    p.add_argument("--duration", type=float, default=None, help="seconds of each rate's window")
    p.add_argument("--smoke", action="store_true", help="a tiny model on CPU, two layouts, tiny rates")
    p.add_argument("--report", action="store_true", help="only write the table and its plots from --out")
    p.add_argument("--lanes", type=int, default=1, help="layouts measured at once, each on its own --gpus GPUs")
    p.add_argument("--frontends", type=int, default=1, help="router processes of each cluster (a table's setting)")
    p.add_argument("--lane-gpus", default=None, help=argparse.SUPPRESS)  # NOTE: a lane's child (goodput_lanes.py)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    deadline = Deadline(args.deadline_s)
    os.environ.update(MULTICAST_OFF)  # NOTE: before any process (or CUDA context) exists
    setup = SMOKE if args.smoke else GPU
    setup = dataclasses.replace(setup, warmup_s=args.warmup or setup.warmup_s, duration_s=args.duration or
                                setup.duration_s)  # fmt: skip
    profile = Profile.read(args.profile)
    num_gpus = args.gpus or profile.num_gpus
    layouts = layouts_for(num_gpus, tp_sizes=profile.tp_sizes)
    names = args.layouts.split(",") if args.layouts else SMOKE_LAYOUTS if args.smoke else [x.name for x in layouts]
    if unknown := set(names) - {x.name for x in layouts}:
        print(f"unknown layouts {sorted(unknown)}: the planner has {[x.name for x in layouts]}", file=sys.stderr)
        return 2
    layouts = [x for x in layouts if x.name in names]
    workloads = (args.workloads or ("chat" if args.smoke else ",".join(WORKLOADS))).split(",")
    slos = {slo_tag(s): s for s in map(plan_cli.parse_slo, args.slos)}
    if problem := host_problem(args, setup, profile, num_gpus):
        print(problem, file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings, header = call_settings(args, setup, num_gpus, slos), call_header(setup, argv, args.profile)
    header |= {"lanes": args.lanes} if args.lanes > 1 else {}
    try:
        measuring = args.lanes > 1 and not args.report
        lanes = (
            goodput_lanes.lane_gpus(goodput_lanes.gpu_uuids(setup.device), args.lanes, num_gpus) if measuring else []
        )
        if not args.lane_gpus:  # NOTE: a lane's child: its parent recorded the call and writes the table
            record_call(out, settings, header, check=not args.report)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    plans = {w: {tag: load_plan(out, plan_argv(args.profile, w, s, num_gpus, setup), header) for tag, s in
                 slos.items()} for w in workloads}  # fmt: skip
    pairs = remaining_pairs(out, [layout.name for layout in layouts], workloads)
    if pairs and not args.report and args.lanes > 1:
        run_in_lanes(argv, setup, plans, layouts, pairs, deadline, lanes, out)
    elif pairs and not args.report:
        scratch = Path(tempfile.mkdtemp(prefix="pdserve-goodput-"))
        try:
            model = Path(args.model) if args.model else write_model(setup, scratch / "model")
            lane = tuple(args.lane_gpus.split(",")) if args.lane_gpus else ()
            ctx = Context(setup, out, profile, model, scratch, deadline, slos, plans, header, lane, args.frontends)
            run_pairs(ctx, layouts, pairs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.lane_gpus:
        return 0
    extra = {"num_gpus": num_gpus, "profile": args.profile, "profile_gpu": profile.gpu, "settings": settings}
    table = build_table(out, layouts, plans, slos, header | extra)
    write_json(out / "table.json", table)
    (out / "table.md").write_text(table_md(table))
    write_plots(out, layouts, table)
    print(table_md(table), flush=True)
    return 0 if table["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
