#!/usr/bin/env python3
"""Device command (kind nvidia-h200-x4, carry [".whl", ".ab"], timeout_s 600; about 6-8 minutes):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null; bash scripts/package_links.sh /tmp/pkg >/dev/null; export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; python3 scripts/bench_ab_trees.py run --out $OUT

On 2 GPUs (kind nvidia-h200-x2, same carry) one mechanism a call, --trees no-deferred-ids, no-deferred-commits or
no-deferred-frees (about 6-8 minutes each):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null; bash scripts/package_links.sh /tmp/pkg >/dev/null; export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; python3 scripts/bench_ab_trees.py run --trees no-deferred-frees --out $OUT

First, here (the device call sends the working tree, not .git): the trees into the git-ignored .ab/ (~1.1 MB each)

    python scripts/bench_ab_trees.py prepare

A/B of the engine's deferred host work (issue 38) in one call: the branches' base commit ("on", .ab/on) against
trees that each lack one mechanism ("off": branches ab/no-deferred-ids, ab/no-deferred-commits,
ab/no-deferred-frees), each tree on its own GPU at once, the GPUs swapped (reversed) in a second round. A tree runs
as the package `pdserve` from its own link dir (scripts/package_links.sh), on one GPU named by UUID (a cluster's
private MPS daemon would remap an index), measured by this checkout's scripts, the same for every tree:
(a) bench_prefill.py's 4000-token prefill (prefix caching off, as benchmarks.md quotes it, and on),
(b) bench_decode.py's CUDA-graph batch, (c) bench_serving_suite.py's loads on a cluster per tree: long-prompt
interference disaggregated and decode-only, shared prefix at 10/s, the exact hit; interference colocated.
$OUT: summary.json, summary.md and ab_runs.tar.gz (each lane's JSONs, logs and step times).
"""  # noqa: E501 - the device command is one line

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_serving_suite import Cluster, jit_compiles

ROOT = Path(__file__).resolve().parents[1]
AB_DIR = ROOT / ".ab"
BRANCHES = ("ab/no-deferred-ids", "ab/no-deferred-commits", "ab/no-deferred-frees")
BASELINE = "on"
TREE_FILE = "AB_TREE.json"
EXPORTED = ("core", "kernels", "kvtransfer", "router", "prefill_worker", "decode_worker", "proto")
EXPORTED_FILES = ("scripts/package_links.sh", "pyproject.toml")
"""What a tree needs on the GPU host: the package folders and the script that links them as `pdserve`."""
SEND_LIMIT = 64 << 20
"""The device call's working tree, carried paths included."""
BASE_PORT = 50171
"""Lane slot s serves gRPC on BASE_PORT + 10 s (HTTP on the next port); metrics on free ports."""
PREFILL_TOKENS, PREFILL_REPEATS, DECODE_REPEATS = 4000, 30, 5
FIRST_BATCH_SHARE = 1.2
"""The first batch's share of the budget against 1 for each later one (cold Triton cache, cold page cache)."""
STEP_MIN_S = {"micro": 60.0, "disagg": 110.0, "colocated": 55.0}
"""Seconds a lane step needs at least on a warm H100/H200 (model, graphs, loads); a step is skipped, not cut, when
less is left before the lane's deadline."""
SERVING_METRICS = (
    ("interference-disagg", "short", "median_itl_ms", "short ITL p50"),
    ("interference-disagg", "short", "p99_itl_ms", "short ITL p99"),
    ("interference-disagg", "long", "median_ttft_ms", "long TTFT p50"),
    ("interference-disagg", "long", "p99_ttft_ms", "long TTFT p99"),
    ("interference-decode-only", "short", "median_itl_ms", "short ITL p50"),
    ("interference-decode-only", "short", "p99_itl_ms", "short ITL p99"),
    ("shared-cache-rate10", None, "median_ttft_ms", "TTFT p50"),
    ("shared-cache-rate10", None, "p99_ttft_ms", "TTFT p99"),
    ("exact-hit", None, "median_ttft_ms", "TTFT p50"),
    ("exact-hit", None, "p99_ttft_ms", "TTFT p99"),
    ("interference-colocated", "short", "median_itl_ms", "short ITL p50"),
    ("interference-colocated", "short", "p99_itl_ms", "short ITL p99"),
    ("interference-colocated", "long", "median_ttft_ms", "long TTFT p50"),
    ("interference-colocated", "long", "p99_ttft_ms", "long TTFT p99"),
)
"""(run, tag of metrics_by_tag or None for all requests, field, label): every one in ms, lower is better."""


# --- prepare (here) ----------------------------------------------------------------------------------------------
def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def export_tree(repo: Path, ref: str, dest: Path) -> int:
    """The package folders of `ref` into dest (replaced); bytes written."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    paths = [p for p in (*EXPORTED, *EXPORTED_FILES) if git(repo, "ls-tree", "--name-only", ref, p)]
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", ref, *paths], check=True,
                             capture_output=True).stdout  # fmt: skip
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())


def prepare(repo: Path, branches: list[str], dest: Path, baseline: str | None = None) -> list[dict[str, Any]]:
    """.ab/on from the branches' common base (or `baseline`), .ab/<name> from each branch ab/<name>, each with its
    AB_TREE.json; the folder git-ignored; ValueError if the device call would exceed its size limit."""
    base = git(repo, "rev-parse", baseline or git(repo, "merge-base", "--octopus", *branches))
    trees = [(BASELINE, base, None), *((b.rsplit("/", 1)[-1], git(repo, "rev-parse", b), b) for b in branches)]
    exclude = repo / git(repo, "rev-parse", "--git-path", "info/exclude")
    if "/.ab/" not in exclude.read_text().split() if exclude.exists() else True:
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with exclude.open("a") as f:
            f.write("/.ab/\n")
    for stale in dest.glob("*") if dest.exists() else ():
        if stale.name not in {name for name, _, _ in trees}:
            shutil.rmtree(stale)
    records: list[dict[str, Any]] = []
    for name, commit, branch in trees:
        size = export_tree(repo, commit, dest / name)
        record: dict[str, Any] = {"name": name, "commit": commit, "branch": branch, "bytes": size,
                  "subject": git(repo, "log", "-1", "--format=%s", commit),
                  "removed": git(repo, "diff", "--shortstat", base, commit) if branch else "",
                  "base": base}  # fmt: skip
        (dest / name / TREE_FILE).write_text(json.dumps(record, indent=1))
        records.append(record)
    if git(repo, "diff", "--stat", base, "HEAD", "--", *EXPORTED):
        print(f"warning: HEAD's package folders differ from the branches' base {base[:10]}: rebase the branches onto "
              "HEAD to measure the engine as it is now", flush=True)  # fmt: skip
    total = send_size(repo)
    print(f"trees {[r['name'] for r in records]}: {sum(r['bytes'] for r in records) / 1e6:.2f} MB; the device "
          f"call sends {total / 2**20:.1f} MiB of {SEND_LIMIT / 2**20:.0f}")  # fmt: skip
    if total > SEND_LIMIT:
        raise ValueError(f"the device call would send {total} bytes, more than {SEND_LIMIT}")
    return records


def send_size(repo: Path, carried: tuple[str, ...] = (".whl", ".ab")) -> int:
    """Bytes of what a device call sends: tracked and untracked-not-ignored files, plus the carried folders."""
    listed = git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    files = [repo / p for p in listed if p] + [f for c in carried for f in (repo / c).rglob("*")]
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


# --- run (GPU host) ----------------------------------------------------------------------------------------------
def load_trees(ab_dir: Path, names: list[str] | None = None) -> list[dict[str, Any]]:
    """The prepared trees (AB_TREE.json + "path"), the baseline first; `names` picks trees besides it."""
    trees = [json.loads(f.read_text()) | {"path": str(f.parent)} for f in sorted(ab_dir.glob(f"*/{TREE_FILE}"))]
    trees = [t for t in trees if t["name"] == BASELINE or names is None or t["name"] in names]
    if not any(t["name"] == BASELINE for t in trees) or len(trees) < 2:
        raise SystemExit(f"no baseline and tree to compare under {ab_dir}: run `{Path(__file__).name} prepare` first")
    return sorted(trees, key=lambda t: (t["name"] != BASELINE, t["name"]))


def schedule(names: list[str], num_gpus: int, rounds: int) -> list[list[list[tuple[str, int]]]]:
    """Per round, batches of (lane, GPU slot) run at once. Trees go on slots 0, 1, ... in even rounds and on the
    slots in reverse in odd ones, so a tree and the one at the mirrored slot swap GPUs; a batch's spare slots run
    the baseline again (lanes "on.2", ...), which measures its spread within a round."""
    lanes = list(names)
    while len(lanes) % num_gpus:
        lanes.append(f"{names[0]}.{lanes.count(names[0]) + sum(x.startswith(names[0] + '.') for x in lanes) + 1}")
    batches = [lanes[i : i + num_gpus] for i in range(0, len(lanes), num_gpus)]
    plan = []
    for r in range(rounds):
        slots = list(range(num_gpus)) if r % 2 == 0 else list(range(num_gpus))[::-1]
        plan.append([list(zip(batch, slots, strict=True)) for batch in batches])
    return plan


def tree_of(lane: str) -> str:
    """The tree a lane runs ("on.2" -> "on")."""
    return lane.split(".", 1)[0]


def host_gpus(spec: str | None, smoke: bool) -> list[dict[str, str]]:
    """index, name and UUID of each GPU used (nvidia-smi; --gpus picks indices); --smoke: CPU slots."""
    if smoke:
        return [{"index": i, "name": "cpu", "uuid": ""} for i in (spec or "0,1").split(",")]
    query = ["nvidia-smi", "--query-gpu=index,name,uuid", "--format=csv,noheader"]
    lines = subprocess.run(query, check=True, capture_output=True, text=True).stdout.splitlines()
    rows = [dict(zip(("index", "name", "uuid"), (x.strip() for x in line.split(",")), strict=True)) for line in lines]
    return [g for g in rows if spec is None or g["index"] in spec.split(",")]


def provides_pdserve(entry: str) -> bool:
    """A PYTHONPATH entry that would import another tree's `pdserve` (a link dir, or the checkout)."""
    return bool(entry) and ((Path(entry) / "pdserve").exists() or Path(entry).resolve() == ROOT)


def lane_env(base: dict[str, str], link_dir: Path, gpu_uuid: str, tmp: Path, threads: int) -> dict[str, str]:
    """A lane's environment: its tree's link dir in place of any other `pdserve` on PYTHONPATH, its GPU alone,
    its own TMPDIR (run dirs with their MPS pipes, model folders)."""
    keep = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and not provides_pdserve(p)]
    return base | {
        "PYTHONPATH": os.pathsep.join([str(link_dir), *keep]), "CUDA_VISIBLE_DEVICES": gpu_uuid, "TMPDIR": str(tmp),
        "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
    }  # fmt: skip


def link_tree(tree: dict[str, Any], link_dir: Path) -> Path:
    """link_dir/pdserve/{core,...} -> the tree's folders, by the tree's own package_links.sh."""
    subprocess.run(["bash", str(Path(tree["path"]) / "scripts" / "package_links.sh"), str(link_dir)], check=True)
    return link_dir


def run_batch(lanes: list[tuple[list[str], Path, dict[str, str]]], deadline: float) -> None:
    """Run lanes (argv, folder, env) at once until they end or the deadline: then SIGTERM (each stops its
    clusters), SIGKILL after 20 s, and what they left behind (workers, MPS daemons under their TMPDIR)."""
    procs = []
    for argv, folder, env in lanes:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "lane.log", "w") as log:
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(1.0, deadline - time.time()))
    late = [(p, env) for p, (_, _, env) in zip(procs, lanes, strict=True) if p.poll() is None]
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        for proc, _ in late:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        for proc, _ in late:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait_s)
    for _, env in late:
        print(f"lane under {env['TMPDIR']} ran past its deadline and was stopped", flush=True)
        end_leftovers(Path(env["TMPDIR"]))


def end_leftovers(tmp: Path) -> None:
    """SIGKILL processes whose command line names tmp (a killed lane's cluster workers: each runs in its own
    process group), and quit the MPS daemons whose pipes are under tmp."""
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if str(tmp).encode() in (entry / "cmdline").read_bytes() and int(entry.name) != os.getpid():
                os.kill(int(entry.name), signal.SIGKILL)
    exe = shutil.which("nvidia-cuda-mps-control")
    for pipe in tmp.glob("*/mps/pipe") if exe else ():
        subprocess.run([str(exe)], input=b"quit\n", env=os.environ | {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}, timeout=30,
                       check=False)  # fmt: skip


def lane_argv(lane: str, rnd: int, tree_path: str, folder: Path, slot: int, gpu: dict[str, str], deadline: float,
              threads: int, smoke: bool) -> list[str]:  # fmt: skip
    argv = [sys.executable, str(Path(__file__).resolve()), "lane", "--tree", lane, "--round", str(rnd), "--tree-path",
            tree_path, "--out", str(folder), "--port", str(BASE_PORT + 10 * slot), "--deadline", f"{deadline:.0f}",
            "--threads", str(threads), "--gpu", json.dumps(gpu)]  # fmt: skip
    return argv + (["--smoke"] if smoke else [])


def run(args: argparse.Namespace) -> int:
    started = time.time()
    out, work = Path(args.out), Path(tempfile.mkdtemp(prefix="ab-work-"))
    out.mkdir(parents=True, exist_ok=True)
    trees = load_trees(Path(args.ab_dir), args.trees.split(",") if args.trees else None)
    gpus = host_gpus(args.gpus, args.smoke)
    plan = schedule([t["name"] for t in trees], len(gpus), args.rounds)
    paths = {t["name"]: t["path"] for t in trees}
    links = {t["name"]: link_tree(t, work / "pkg" / t["name"]) for t in trees}
    threads = max(1, (os.cpu_count() or 2) // len(gpus))
    batches = [(r, batch) for r, round_batches in enumerate(plan) for batch in round_batches]
    print(f"{len(trees)} trees on {len(gpus)} GPUs ({gpus[0]['name']}), {args.rounds} rounds, {len(batches)} batches "
          f"in {args.budget_s:.0f} s: {json.dumps(plan)}", flush=True)  # fmt: skip
    shares = [FIRST_BATCH_SHARE] + [1.0] * (len(batches) - 1)  # NOTE: the first batch compiles Triton's kernels
    if args.budget_s / sum(shares) < sum(STEP_MIN_S.values()) + 25:
        print(f"warning: {args.budget_s / sum(shares):.0f} s a batch: lanes will skip steps (fewer trees a call, or "
              "more GPUs)", flush=True)  # fmt: skip
    for k, (r, batch) in enumerate(batches):
        deadline = started + args.budget_s * sum(shares[: k + 1]) / sum(shares)
        lanes = []
        for lane, slot in batch:
            folder, gpu, tree = work / "runs" / f"r{r + 1}" / lane, gpus[slot], tree_of(lane)
            argv = lane_argv(lane, r + 1, paths[tree], folder, slot, gpu, deadline - 25, threads, args.smoke)
            env = lane_env(dict(os.environ), links[tree], gpu["uuid"], work / "tmp" / f"r{r + 1}-{lane}", threads)
            lanes.append((argv, folder, env))
        run_batch(lanes, deadline)
        for _, folder, _ in lanes:
            steps = (read_json(folder / "lane.json") or {}).get("steps")
            print(f"round {r + 1} {folder.name}: {steps} at {time.time() - started:.0f} s", flush=True)
    summary = summarize(collect(work / "runs"), trees, gpus, plan, args, time.time() - started)
    write_outputs(summary, work / "runs", out)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _without_logs(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if member.name.endswith(".log") else member


def write_outputs(summary: dict[str, Any], runs: Path, out: Path) -> None:
    """summary.json, summary.md, ab_runs.tar.gz (the lanes' files; logs dropped if it grows past 15 MiB)."""
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    markdown = summary_markdown(summary)
    (out / "summary.md").write_text(markdown)
    for keep_logs in (True, False):
        with tarfile.open(out / "ab_runs.tar.gz", "w:gz") as tar:
            tar.add(runs, arcname="runs", filter=None if keep_logs else _without_logs)
        if (out / "ab_runs.tar.gz").stat().st_size < 15 << 20:
            break
    print(markdown, flush=True)


# --- one lane: one tree on one GPU -------------------------------------------------------------------------------
def lane(args: argparse.Namespace) -> int:
    """The tree's measurements in order, each skipped when its minimum time no longer fits before the deadline;
    lane.json after each step (tree, GPU, which pdserve was imported, step seconds and errors)."""
    import importlib.util

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # NOTE: so `finally` stops a running cluster
    out = Path(args.out)
    spec = importlib.util.find_spec("pdserve.core")
    core = Path(next(iter(spec.submodule_search_locations or []))).resolve() if spec else None
    record: dict[str, Any] = {"tree": tree_of(args.tree), "lane": args.tree, "round": args.round,
                              "gpu": json.loads(args.gpu), "pdserve_core": str(core), "steps": {}}  # fmt: skip
    record["imports_its_tree"] = core is not None and core == (Path(args.tree_path) / "core").resolve()
    record["loads"] = {label: dict(zip(("cluster_flags", "loads"), serving_plan(label, args.smoke), strict=True))
                       for label in ("disagg", "colocated")}  # fmt: skip
    steps = {"micro": lambda: micro_step(args, out), "disagg": lambda: serving_step(args, out, "disagg"),
             "colocated": lambda: serving_step(args, out, "colocated")}  # fmt: skip
    for name, step in steps.items():
        left = args.deadline - time.time()
        if left < STEP_MIN_S[name] * (0.2 if args.smoke else 1.0) or not record["imports_its_tree"]:
            record["steps"][name] = {"skipped": f"{left:.0f} s left" if record["imports_its_tree"] else "wrong tree"}
            continue
        start = time.time()
        try:
            step()
            record["steps"][name] = {"seconds": round(time.time() - start, 1)}
        except Exception as exc:  # noqa: BLE001 - a failed step is recorded, the next one still runs
            record["steps"][name] = {"seconds": round(time.time() - start, 1), "error": repr(exc)[-2000:]}
        (out / "lane.json").write_text(json.dumps(record, indent=1))
    (out / "lane.json").write_text(json.dumps(record, indent=1))
    return 0


def micro_step(args: argparse.Namespace, out: Path) -> None:
    """bench_prefill / bench_decode in a child process, so its GPU memory is gone before a cluster sizes its pools."""
    argv = [sys.executable, str(Path(__file__).resolve()), "micro", "--out", str(out / "micro.json")]
    timeout = min(240.0, max(10.0, args.deadline - time.time()))
    with open(out / "micro.log", "w") as log:
        subprocess.run(argv + (["--smoke"] if args.smoke else []), stdout=log, stderr=subprocess.STDOUT,
                       timeout=timeout, check=True)  # fmt: skip


def micro(args: argparse.Namespace) -> int:
    """The prefill (caching off: bench_prefill.bench_engine, as benchmarks.md quotes it; on: prefill_first_token)
    and bench_decode's CUDA-graph batch; --smoke: a tiny model's prefill on CPU."""
    result: dict[str, Any] = {}
    if args.smoke:
        result["prefill_cached"] = prefill_first_token(tiny_model(Path(tempfile.mkdtemp())), 200, 3, True, "cpu")
    else:
        import bench_decode
        import bench_prefill
        import torch

        folder = bench_prefill.write_config(Path(tempfile.mkdtemp()))
        times = bench_prefill.bench_engine(folder, PREFILL_TOKENS, PREFILL_REPEATS, "triton")
        first = bench_prefill.TTFT["pdserve-triton"]
        result["prefill"] = {"median_ms": statistics.median(times), "ttft_median_ms": statistics.median(first)}
        result["prefill_cached"] = prefill_first_token(folder, PREFILL_TOKENS, PREFILL_REPEATS, True, "cuda")
        folder = bench_decode.write_config(Path(tempfile.mkdtemp()))
        rates = bench_decode.bench_engine(folder, bench_decode.prompts_of(128), 128, DECODE_REPEATS, eager=False)
        result["decode"] = {"median_tok_per_s": statistics.median(rates), "rates": rates,
                            "step_ms": 1e3 * 128 / statistics.median(rates)}  # fmt: skip
        result["gpu"] = torch.cuda.get_device_name()
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def prefill_first_token(folder: Path, tokens: int, repeats: int, caching: bool, device: str) -> dict[str, float]:
    """bench_prefill's engine call (add a fresh prompt, step to its first token, flush_commits) with prefix caching
    as asked: with it on, a computed prompt's blocks and row are registered (deferred or not)."""
    import numpy as np
    import torch

    from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from pdserve.core.engine import Engine
    from pdserve.core.sampling_params import SamplingParams

    cuda = device == "cuda"
    model = ModelConfig.from_pretrained(folder, dtype="bfloat16" if cuda else "float32", load_format="dummy")
    engine = Engine(EngineConfig(
        model, CacheConfig(num_blocks=tokens // 16 + 64, enable_prefix_caching=caching),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=tokens), device=device,
        attention_backend="triton" if cuda else "torch",
    ))  # fmt: skip
    rng = np.random.default_rng(0)  # NOTE: read-only int32 arrays, as a prefill worker unpacks a GenerateCmd's ids
    ids = [rng.integers(0, model.vocab_size, tokens).astype("<i4").tobytes() for _ in range(repeats + 3)]
    prompts = [np.frombuffer(raw, dtype="<i4") for raw in ids]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    firsts, calls = [], []
    for i, prompt in enumerate(prompts):
        sync()
        start = time.perf_counter()
        engine.add_request(f"ab-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
        while not engine.step():
            pass
        first = time.perf_counter()
        engine.flush_commits()
        sync()
        if i >= 3:
            firsts.append((first - start) * 1e3)
            calls.append((time.perf_counter() - start) * 1e3)
    return {"ttft_median_ms": statistics.median(firsts), "median_ms": statistics.median(calls)}


def tiny_model(folder: Path) -> Path:
    """--smoke's model: the Llama bench shape cut to a few small layers, GPT-2's tokenizer."""
    from make_bench_model import LLAMA
    from transformers import AutoConfig

    from pdserve.core.model_store import GPT2_VOCAB_SIZE, write_gpt2_tokenizer

    spec = dict(LLAMA, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=GPT2_VOCAB_SIZE, max_position_embeddings=1024)  # fmt: skip
    AutoConfig.for_model(spec.pop("model_type"), **spec).save_pretrained(folder)
    write_gpt2_tokenizer(folder)
    return folder


# --- serving ----------------------------------------------------------------------------------------------------
SMOKE_LONG = ["--dataset", "long-prompt", "--num-short", "4", "--short-output-len", "8", "--long-input-len", "200"]
SMOKE_LONG += ["--long-output-len", "2", "--long-rate", "1", "--duration", "2"]
SMOKE_EXACT = ["--dataset", "shared-prefix", "--num-groups", "1", "--prefix-len", "100", "--suffix-len", "0"]
SMOKE_EXACT += ["--output-len", "1", "--num-prompts", "5", "--max-concurrency", "1"]
SMOKE_WARMUP = ["--dataset", "random", "--num-prompts", "4", "--input-len", "8:100", "--output-len", "2:4"]
SMOKE_FLAGS = ["--load-format", "dummy", "--max-num-seqs", "16"]
SMOKE_PLAN = {
    "disagg": (SMOKE_FLAGS, [("interference-disagg", SMOKE_LONG), ("exact-hit", SMOKE_EXACT)]),
    "colocated": ([*SMOKE_FLAGS, "--colocated"], [("interference-colocated", SMOKE_LONG)]),
}
"""--smoke's clusters (tiny model, CPU) and loads."""


def serving_plan(label: str, smoke: bool) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """A cluster's flags and its loads after the warm-up, as bench_serving_suite.py runs them (--smoke: tiny)."""
    import bench_serving_suite as suite

    if smoke:
        return SMOKE_PLAN[label]
    if label == "colocated":
        return [*suite.WORKER_FLAGS, *suite.COLOCATED_FLAGS], [("interference-colocated", suite.WITH_LONG)]
    shared = [run for run in suite.shared_prefix_runs("cache") if run[0].endswith("-rate10")]
    loads = [("interference-disagg", suite.WITH_LONG), ("interference-decode-only", suite.DECODE_ONLY), *shared]
    return suite.WORKER_FLAGS, [*loads, ("exact-hit", suite.EXACT)]


def run_load(cluster: Cluster, folder: Path, name: str, load: list[str], port: int) -> dict[str, Any]:
    """One pdserve-bench-serving run (its JSON report) with the decode worker's step quantiles and the kernels
    compiled while it ran added, as bench_serving_suite.run_bench does."""
    from pdserve.core.step_timer import quantile_ms
    from pdserve.router.benchmark import cli as bench

    path = folder / f"{name}.json"
    time.sleep(0.6)  # NOTE: two heartbeat intervals, so the counters cover the last steps
    before, compiles, start = cluster.counters("decode-0"), jit_compiles(cluster), time.time()
    code = bench.main(["--address", f"127.0.0.1:{port}", "--no-progress", "--result-json", str(path), *load])
    time.sleep(0.6)
    after, report = cluster.counters("decode-0"), json.loads(path.read_text())
    steps = {f"p{int(q * 100)}": quantile_ms(before, after, q) for q in (0.5, 0.9, 0.99)}
    report |= {"exit_code": code, "seconds": round(time.time() - start, 1), "load": load,
               "jit_compiles_serving": jit_compiles(cluster) - compiles,
               "worker_step_ms": {k: "inf" if v == float("inf") else v for k, v in steps.items()}}  # fmt: skip
    path.write_text(json.dumps(report, indent=1))
    print(f"== {name}: exit {code}, {report['seconds']} s, steps {steps}", flush=True)
    return report  # type: ignore[no-any-return]


def serving_step(args: argparse.Namespace, out: Path, label: str) -> None:
    """One cluster of the tree on the lane's GPU: warm-up (kernels compile), then its loads in order."""
    import bench_serving_suite as suite
    from make_bench_model import write_bench_model

    tmp = Path(os.environ.get("TMPDIR", tempfile.gettempdir()))
    model = tmp / "bench-model"
    if not (model / "config.json").exists():
        tiny_model(model) if args.smoke else write_bench_model("llama-1b", model)
    flags, loads = serving_plan(label, args.smoke)
    flags = [*flags, "--cpu-threads", str(max(1, args.threads // 2))]
    run_dir, folder = tmp / f"run-{label}", out / "serving"
    shutil.rmtree(run_dir, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda"
    log = out / f"cluster-{label}.log"
    metrics = ["--metrics-port", "0"]  # NOTE: free ports: lanes side by side
    cluster = Cluster(model, run_dir, [*metrics, *flags], log, args.port, device)
    try:
        print(f"== cluster {label} ready in {cluster.wait_ready():.1f} s", flush=True)
        run_load(cluster, folder, f"warmup-{label}", SMOKE_WARMUP if args.smoke else suite.WARMUP, args.port)
        for name, load in loads:
            if time.time() > args.deadline:
                raise TimeoutError(f"the lane's deadline passed before {name}")
            run_load(cluster, folder, name, load, args.port)
    finally:
        cluster.stop()
        if (run_dir / "logs").exists():
            shutil.copytree(run_dir / "logs", out / f"logs-{label}", dirs_exist_ok=True)


# --- summary -----------------------------------------------------------------------------------------------------
NOISE_FACTOR = 2.0
"""How many times its noise a difference must exceed. With two rounds of Gaussian noise a metric the mechanism does
not move passes 1x 22% of the time, 2x 7%; at 2x a true effect of 3 standard deviations passes half the time."""
PRIMARY = {
    "no-deferred-ids": ("prefill 4000, caching off: first token", "prefill 4000, caching on: first token",
                        "interference-disagg: long TTFT p50", "interference-colocated: long TTFT p50",
                        "interference-disagg: short ITL p50"),
    "no-deferred-commits": ("prefill 4000, caching on: first token", "shared-cache-rate10: TTFT p50",
                            "interference-disagg: long TTFT p50", "interference-colocated: long TTFT p50"),
    "no-deferred-frees": ("prefill 4000, caching off: first token", "prefill 4000, caching on: first token",
                          "exact-hit: TTFT p50", "interference-disagg: short ITL p50",
                          "interference-decode-only: short ITL p50", "interference-colocated: short ITL p50"),
}  # fmt: skip
"""The metrics on each mechanism's path (ids: long prompts' and handoffs' lists; commits: prefix caching on; frees:
requests finishing at their first token, decode streams ending), which its verdict rests on; every metric is
reported. A tree not named here is judged on all."""
NOISE_RULE = (
    "Per metric (ms, lower is better), off − on is averaged over the rounds; its noise is the larger of the "
    "baseline's spread over all its runs (rounds and replicas, on different GPUs) and the tree's own spread over its "
    f"rounds. A difference is beyond noise when |mean(off − on)| exceeds {NOISE_FACTOR:g}x that noise and every "
    "round's difference has the same sign (with two rounds a metric with no effect still passes ~7% of the time); "
    "one round gives no noise estimate. Verdict: keep when a metric on the mechanism's path (marked) is slower "
    "without it beyond noise, delete when none is; a keep resting on one metric wants a rerun."
)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def lane_metrics(folder: Path) -> dict[str, float]:
    """A lane's figures by metric name: the prefills' and decode step's medians, the serving loads' quantiles
    (a run with failed requests gives none)."""
    metrics: dict[str, float] = {}
    micro = read_json(folder / "micro.json") or {}
    for key, label in (("prefill", "prefill 4000, caching off"), ("prefill_cached", "prefill 4000, caching on")):
        if key in micro:
            metrics[f"{label}: first token"] = micro[key]["ttft_median_ms"]
            metrics[f"{label}: call"] = micro[key]["median_ms"]
    if "decode" in micro:
        metrics["decode 128 x 128: step"] = micro["decode"]["step_ms"]
    for run, tag, field, label in SERVING_METRICS:
        report = read_json(folder / "serving" / f"{run}.json")
        if report is None or report["metrics"].get("failed"):
            continue
        block = report["metrics_by_tag"].get(tag, {}) if tag else report["metrics"]
        if block.get(field) is not None:
            metrics[f"{run}: {label}"] = block[field]
    return metrics


def collect(runs: Path) -> list[dict[str, Any]]:
    """Each lane's record (lane.json, or its folder's names) with its metrics."""
    out = []
    for folder in sorted(p for p in runs.glob("r*/*") if p.is_dir()):
        record = read_json(folder / "lane.json") or {"lane": folder.name, "round": int(folder.parent.name[1:])}
        record.setdefault("tree", tree_of(record["lane"]))
        out.append(record | {"metrics": lane_metrics(folder)})
    return out


def spread(values: list[float]) -> float:
    return max(values) - min(values)


def compare_metric(on: dict[int, list[float]], off: dict[int, list[float]]) -> dict[str, Any] | None:
    """One metric of a tree against the baseline, round by round (see NOISE_RULE); None without a common round."""
    rounds = sorted(on.keys() & off.keys())
    if not rounds:
        return None
    on_r, off_r = [statistics.fmean(on[r]) for r in rounds], [statistics.fmean(off[r]) for r in rounds]
    diffs = [b - a for a, b in zip(on_r, off_r, strict=True)]
    diff, base = statistics.fmean(diffs), statistics.fmean(on_r)
    noise = None
    if len(rounds) > 1:
        noise = max(spread([x for r in rounds for x in on[r]]), spread([x for r in rounds for x in off[r]]))
    same_sign = all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
    beyond = noise is not None and abs(diff) > NOISE_FACTOR * noise and same_sign
    return {"rounds": rounds, "on": on_r, "off": off_r, "diff": diff, "diff_pct": 100 * diff / base if base else None,
            "noise": noise, "beyond_noise": beyond}  # fmt: skip


def verdict(rows: dict[str, dict[str, Any]], primary: tuple[str, ...] | None) -> dict[str, Any]:
    """From the metrics on the mechanism's path (all without `primary`); the others beyond noise listed apart."""
    judged = {m: r for m, r in rows.items() if primary is None or m in primary}
    worse = [m for m, r in judged.items() if r["beyond_noise"] and r["diff"] > 0]
    better = [m for m, r in judged.items() if r["beyond_noise"] and r["diff"] < 0]
    if all(r["noise"] is None for r in judged.values()):  # NOTE: a metric a round lacks is judged on none
        word = "n/a: no data" if not judged else "n/a: one round, no noise estimate"
    else:
        word = "mixed" if worse and better else "keep" if worse else "delete (faster without)" if better else "delete"
    other = [m for m, r in rows.items() if m not in judged and r["beyond_noise"]]
    return {"verdict": word, "judged_on": list(judged), "slower_without": worse, "faster_without": better,
            "other_beyond_noise": other}  # fmt: skip


def compare(runs: list[dict[str, Any]], primary: dict[str, tuple[str, ...]] = PRIMARY) -> dict[str, dict[str, Any]]:
    """Per tree but the baseline: each metric against the baseline's, and the verdict."""
    values: dict[str, dict[str, dict[int, list[float]]]] = {}
    for run in runs:
        for metric, value in run["metrics"].items():
            values.setdefault(run["tree"], {}).setdefault(metric, {}).setdefault(run["round"], []).append(value)
    base = values.get(BASELINE, {})
    result = {}
    for tree in sorted(values.keys() - {BASELINE}):
        rows = {m: compare_metric(base[m], v) for m, v in sorted(values[tree].items()) if m in base}
        kept = {m: r for m, r in rows.items() if r is not None}
        result[tree] = {"rows": kept, **verdict(kept, primary.get(tree))}
    return result


DEVICE_COMMAND = (__doc__ or "").split("\n\n")[1].strip()


def summarize(runs: list[dict[str, Any]], trees: list[dict[str, Any]], gpus: list[dict[str, str]],
              plan: list[Any], args: argparse.Namespace, seconds: float) -> dict[str, Any]:  # fmt: skip
    loads: dict[str, Any] = next((r["loads"] for r in runs if r.get("loads")), {})
    return {
        "what": "A/B of the engine's deferred host work (issue 38): each tree lacks one mechanism, 'on' has all",
        "gpu": ", ".join(sorted({g["name"] for g in gpus})), "gpus": gpus, "seconds": round(seconds, 1),
        "commands": {"device": DEVICE_COMMAND, "run": " ".join(sys.argv), "serving_loads": loads},
        "rounds": args.rounds, "schedule": plan, "noise_rule": NOISE_RULE,
        "trees": [{k: v for k, v in t.items() if k != "path"} for t in trees],
        "runs": runs, "comparisons": compare(runs),
    }  # fmt: skip


def fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def summary_markdown(summary: dict[str, Any]) -> str:
    trees = {t["name"]: t for t in summary["trees"]}
    base = trees.get(BASELINE, {})
    lines = [f"# Deferred host work on and off (issue 38): {summary['gpu']}", "",
             f"{summary['rounds']} rounds, {summary['seconds']:.0f} s; baseline `on` = {str(base.get('commit'))[:10]} "
             f"({str(base.get('subject', '?'))[:100]}).", "", summary["noise_rule"], "",
             "| tree | branch @ commit | removed | verdict | slower without | faster without | other beyond noise |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    comparisons = summary["comparisons"]
    for name, c in comparisons.items():
        t = trees.get(name, {})
        lists = " | ".join("; ".join(c[k]) or "—" for k in ("slower_without", "faster_without", "other_beyond_noise"))
        lines.append(f"| {name} | {t.get('branch')} @ {str(t.get('commit'))[:10]} | {t.get('removed', '')} | "
                     f"**{c['verdict']}** | {lists} |")  # fmt: skip
    lines += ["", "| tree | metric (· on its path) | on, per round | off, per round | off − on | % | noise | beyond |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, c in comparisons.items():
        for metric, r in c["rows"].items():
            mark = " ·" if metric in c["judged_on"] and len(c["judged_on"]) < len(c["rows"]) else ""
            pct = "—" if r["diff_pct"] is None else f"{r['diff_pct']:+.2f}"
            on, off, beyond = " / ".join(map(fmt, r["on"])), " / ".join(map(fmt, r["off"])), r["beyond_noise"]
            lines.append(f"| {name} | {metric}{mark} | {on} | {off} | {r['diff']:+.3f} | {pct} | {fmt(r['noise'])} | "
                         f"{'**yes**' if beyond else 'no'} |")  # fmt: skip
    lines += ["", "| round | lane | GPU | steps (s, or why not) |", "| --- | --- | --- | --- |"]
    for run in summary["runs"]:
        steps = "; ".join(f"{k} {v.get('seconds', v.get('skipped'))}" + (f" ERROR {v['error'][:120]}" if "error" in v
                          else "") for k, v in run.get("steps", {}).items())  # fmt: skip
        lines.append(f"| {run['round']} | {run['lane']} | {run.get('gpu', {}).get('index', '?')} | {steps} |")
    lines += ["", "```", summary["commands"]["device"], summary["commands"]["run"], "```", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="here: export the trees into .ab/ (git-ignored)")
    prep.add_argument("--branches", default=",".join(BRANCHES))
    prep.add_argument("--baseline", default=None, help="the ref .ab/on exports (default: the branches' merge base)")
    prep.add_argument("--dest", default=str(AB_DIR))
    go = sub.add_parser("run", help="GPU host: every tree, every round; summary into --out")
    go.add_argument("--out", required=True)
    go.add_argument("--ab-dir", default=str(AB_DIR))
    go.add_argument("--trees", default=None, help="comma list of trees besides the baseline (default: all)")
    go.add_argument("--gpus", default=None, help="comma list of GPU indices (default: every GPU)")
    go.add_argument("--rounds", type=int, default=2)
    go.add_argument("--budget-s", type=float, default=480.0, help="all rounds together (lanes stop at their share)")
    go.add_argument("--smoke", action="store_true", help="CPU, a tiny model, tiny loads: the plumbing only")
    one = sub.add_parser("lane", help="internal: one tree on one GPU")
    for flag in ("--tree", "--tree-path", "--out", "--gpu"):
        one.add_argument(flag, required=True)
    one.add_argument("--round", type=int, required=True)
    one.add_argument("--port", type=int, required=True)
    one.add_argument("--deadline", type=float, required=True)
    one.add_argument("--threads", type=int, default=8)
    one.add_argument("--smoke", action="store_true")
    small = sub.add_parser("micro", help="internal: the prefill and decode benchmarks of the imported tree")
    small.add_argument("--out", required=True)
    small.add_argument("--smoke", action="store_true")
    again = sub.add_parser("summarize", help="the comparisons of a summary.json again (e.g. after a rule change)")
    again.add_argument("--summary", required=True)
    again.add_argument("--out", required=True)
    args = p.parse_args()
    if args.command == "prepare":
        prepare(ROOT, args.branches.split(","), Path(args.dest), args.baseline)
        return 0
    if args.command == "summarize":
        summary = json.loads(Path(args.summary).read_text())
        summary["comparisons"], summary["noise_rule"] = compare(summary["runs"]), NOISE_RULE
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1))
        (Path(args.out) / "summary.md").write_text(summary_markdown(summary))
        return 0
    return {"run": run, "lane": lane, "micro": micro}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
