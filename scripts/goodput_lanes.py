"""Lanes of bench_goodput.py (--lanes K): K layouts measured at once, each in a child process of its own on its own
N GPUs of the host (lane k on GPUs k*N .. k*N+N-1), so a host of K*N GPUs fills an N-GPU table K times faster.

A child runs bench_goodput.py on its share of the layouts with --lane-gpus naming its GPUs by UUID: its clusters'
--prefill-gpus / --decode-gpus name those UUIDs instead of indices, and its environment shows it those GPUs alone
(CUDA_VISIBLE_DEVICES, so a cluster's private MPS daemon sees them alone too). A worker's CUDA_VISIBLE_DEVICES is
set from the flags, and an index there would name the host's GPU of that index, whatever the lane. Lanes share the
host's CPUs: each call's run.json entry records the lanes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from pdserve.router import placement

GPU_FLAGS = ("--prefill-gpus", "--decode-gpus")


def gpu_uuids(device: str) -> list[str]:
    """The host's GPUs by UUID, in index order (nvidia-smi); on CPU (--smoke) four stand-in names."""
    if device != "cuda":
        return [f"cpu-{k}" for k in range(4)]
    uuids = placement.gpu_uuids()
    return [uuids[k] for k in sorted(uuids, key=int)]


def lane_gpus(uuids: Sequence[str], lanes: int, per_lane: int) -> list[list[str]]:
    """Each lane's GPUs; ValueError when the host has fewer than lanes * per_lane."""
    if len(uuids) < lanes * per_lane:
        raise ValueError(f"--lanes {lanes} of {per_lane} GPUs needs {lanes * per_lane}, the host has {len(uuids)}")
    return [list(uuids[k * per_lane : (k + 1) * per_lane]) for k in range(lanes)]


def split(seconds: Mapping[str, float], lanes: int) -> list[list[str]]:
    """Layouts (name -> planned seconds) into at most `lanes` groups of near-equal seconds: the longest first, each
    to the group with the fewest seconds so far; each group keeps the table's order."""
    groups: list[list[str]] = [[] for _ in range(min(lanes, len(seconds)))]
    load = [0.0] * len(groups)
    for name in sorted(seconds, key=lambda n: -seconds[n]):
        k = load.index(min(load))
        groups[k].append(name)
        load[k] += seconds[name]
    order = list(seconds)
    return [sorted(g, key=order.index) for g in groups]


def lane_flags(flags: Sequence[str], gpus: Sequence[str]) -> list[str]:
    """A cluster's flags with the GPU indices of GPU_FLAGS replaced by the lane's GPUs (index i -> gpus[i])."""
    out = list(flags)
    for k, flag in enumerate(out[:-1]):
        if flag in GPU_FLAGS:
            out[k + 1] = ",".join(gpus[int(i)] for i in out[k + 1].split(","))
    return out


def run_lanes(argvs: Sequence[list[str]], gpus: Sequence[list[str]], logs: Path, deadline_s: float) -> list[int]:
    """Start one child a lane (argv, with its GPUs alone visible), wait for all (killed past deadline_s + a grace
    minute), print each one's log; their exit codes."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for k, (argv, lane) in enumerate(zip(argvs, gpus, strict=True)):
        env = os.environ | {"CUDA_VISIBLE_DEVICES": ",".join(lane), "PYTHONUNBUFFERED": "1"}
        log = (logs / f"lane-{k}.log").open("w")
        print(f"== lane {k} on {','.join(lane)}: {' '.join(argv)}", flush=True)
        procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    end = time.monotonic() + deadline_s + 60.0
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
        log.close()
    for k in range(len(procs)):
        print(f"== lane {k} (exit {codes[k]}):\n{(logs / f'lane-{k}.log').read_text()[-3000:]}", flush=True)
    return codes


def child_argv(
    script: str, argv: Sequence[str], layouts: Sequence[str], gpus: Sequence[str], left_s: float
) -> list[str]:
    """A lane's command: this call's arguments without --lanes, --layouts and --deadline-s, then the lane's."""
    keep, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--lanes", "--layouts", "--deadline-s"):
            skip = True
            continue
        if not arg.startswith(("--lanes=", "--layouts=", "--deadline-s=")):
            keep.append(arg)
    lane = ["--layouts", ",".join(layouts), "--lane-gpus", ",".join(gpus), "--deadline-s", f"{left_s:.0f}"]
    return [sys.executable, script, *keep, *lane]
