"""Where a cluster's processes run: the GPUs each worker sees, MPS between roles sharing a GPU, the hosts of a
topology. Used by the launcher (router/cluster_cli.py); standard library only."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from pdserve.core.ipc import Topology


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


def within_visible(gpus: list[str] | None, visible: str | None, flag: str) -> list[str] | None:
    """A GPU list's indices read within the launcher's CUDA_VISIBLE_DEVICES (index i -> its i-th entry), as a
    CUDA program reads them; UUIDs and lists without CUDA_VISIBLE_DEVICES as they are. ValueError past its end."""
    seen = [g.strip() for g in visible.split(",") if g.strip()] if visible else []
    if gpus is None or not seen:
        return gpus
    out = []
    for gpu in gpus:
        if gpu.isdigit() and int(gpu) >= len(seen):
            raise ValueError(f"{flag} {gpu}: CUDA_VISIBLE_DEVICES={visible} shows {len(seen)} GPU(s)")
        out.append(seen[int(gpu)] if gpu.isdigit() else gpu)
    return out


def placement(prefill_gpus: list[str] | None, decode_gpus: list[str] | None, num_prefill: int, num_decode: int,
              prefill_tp: int = 1, decode_tp: int = 1) -> dict[str, str]:  # fmt: skip
    """CUDA_VISIBLE_DEVICES of each worker ({} without --prefill-gpus / --decode-gpus: every worker sees every
    GPU and its ranks use cuda:0..N-1): its compute GPUs (compute_gpus), and for decode j then every prefill GPU
    not among them, whose pools it maps by CUDA IPC and copies from (peer copies; kvtransfer/cuda_ipc.py finds
    them by UUID). ValueError, naming the flags, for a list shorter than its role's TP size."""
    compute = compute_gpus(prefill_gpus, decode_gpus, num_prefill, num_decode, prefill_tp, decode_tp)
    mapped = (prefill_gpus or decode_gpus or []) if num_prefill else []  # colocated decode workers map no pool
    return {
        name: ",".join(dict.fromkeys([*gpus, *mapped]) if name.startswith("decode-") else gpus)
        for name, gpus in compute.items()
    }


def compute_gpus(prefill_gpus: list[str] | None, decode_gpus: list[str] | None, num_prefill: int, num_decode: int,
                 prefill_tp: int = 1, decode_tp: int = 1) -> dict[str, list[str]]:  # fmt: skip
    """The GPUs each worker's ranks run on ({} when neither list is given). One list serves both roles when the
    other is not given. A role's list is cut into groups of its TP size, in order: worker i of the role gets group
    i % groups (rank r on the group's r-th GPU)."""
    if prefill_gpus is None and decode_gpus is None:
        return {}
    prefill_flag = "--prefill-gpus" if prefill_gpus else "--decode-gpus"
    decode_flag = "--decode-gpus" if decode_gpus else "--prefill-gpus"
    prefill_gpus = prefill_gpus or decode_gpus
    decode_gpus = decode_gpus or prefill_gpus
    assert prefill_gpus is not None and decode_gpus is not None
    out: dict[str, list[str]] = {}
    if num_prefill:
        groups = tp_groups(prefill_gpus, prefill_tp, prefill_flag, "--prefill-tp")
        out |= {f"prefill-{i}": groups[i % len(groups)] for i in range(num_prefill)}
    groups = tp_groups(decode_gpus, decode_tp, decode_flag, "--decode-tp")
    return out | {f"decode-{j}": groups[j % len(groups)] for j in range(num_decode)}


def alone_on_their_gpus(compute: dict[str, list[str]]) -> set[str]:
    """Workers none of whose GPUs a worker of the other role runs on: under MPS they keep the whole GPU."""

    def role_gpus(role: str) -> set[str]:
        return {g for name, gpus in compute.items() if name.startswith(role) for g in gpus}

    other = {"prefill-": role_gpus("decode-"), "decode-": role_gpus("prefill-")}
    return {name for name, gpus in compute.items() for role, theirs in other.items()
            if name.startswith(role) and not set(gpus) & theirs}  # fmt: skip


def tp_groups(gpus: list[str], tp_size: int, gpus_flag: str, tp_flag: str) -> list[list[str]]:
    """gpus cut into consecutive groups of tp_size, one per worker's ranks (a shorter rest stays unused);
    ValueError naming both flags when gpus cannot hold one group."""
    if len(gpus) < tp_size:
        raise ValueError(
            f"{gpus_flag} {','.join(gpus)}: {len(gpus)} GPU(s), fewer than {tp_flag} {tp_size} (one GPU per rank)"
        )
    return [gpus[k : k + tp_size] for k in range(0, len(gpus) - tp_size + 1, tp_size)]


def roles_share_a_gpu(prefill_gpus: list[str] | None, decode_gpus: list[str] | None) -> bool:
    """Whether a prefill and a decode worker may run on one GPU (then MPS splits its SMs between them)."""
    if prefill_gpus is None or decode_gpus is None:
        return True
    return bool(set(prefill_gpus) & set(decode_gpus))


def gpu_uuids() -> dict[str, str]:
    """The host's GPU index -> UUID (nvidia-smi, which ignores CUDA_VISIBLE_DEVICES); {} without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    query = [exe, "--query-gpu=index,uuid", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        return {}
    rows = [line.split(",") for line in done.stdout.splitlines()]
    return {row[0].strip(): row[1].strip() for row in rows if len(row) == 2}


class Mps:
    """An MPS control daemon private to this cluster (own pipe and log folders), so prefill and decode on
    one GPU each get a fixed share of its SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) instead of time slices."""

    def __init__(self, run_dir: Path, split: tuple[int, int], whole_gpu: frozenset[str] = frozenset()) -> None:
        self.whole_gpu = whole_gpu
        """Workers alone on their GPUs (alone_on_their_gpus): no SM share, the whole GPU."""
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(run_dir / "mps" / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(run_dir / "mps" / "log"),
        }
        self.split = split
        self.uuids: dict[str, str] = {}
        """The host's GPU index -> UUID (gpu_uuids), read when the daemon starts."""

    def start(self, env: dict[str, str]) -> bool:
        exe = shutil.which("nvidia-cuda-mps-control")
        if exe is None:
            print("pdserve: nvidia-cuda-mps-control not found; running without MPS", file=sys.stderr)
            return False
        for folder in self.env.values():
            Path(folder).mkdir(parents=True, exist_ok=True)
        self.uuids = gpu_uuids()
        subprocess.run([exe, "-d"], env={**env, **self.env}, check=True)
        print(f"pdserve: MPS on, SM share prefill/decode {self.split[0]}/{self.split[1]}%", file=sys.stderr)
        return True

    def worker_env(self, name: str, role: str, visible: str | None = None) -> dict[str, str]:
        """A child's MPS environment: its role's SM share, unless it is alone on its GPUs; {} for the router.
        Its GPUs (visible: the host's indices of its CUDA_VISIBLE_DEVICES) by UUID: an MPS client reads an index
        against the daemon's own CUDA_VISIBLE_DEVICES (NVIDIA's MPS docs), so the host's GPU 3 under a daemon that
        sees GPU 3 alone would be "no CUDA GPU"; a UUID names the same GPU to both."""
        share = {"prefill": self.split[0], "decode": self.split[1]}.get(role)
        if share is None:
            return {}
        out = dict(self.env)
        if visible:
            out["CUDA_VISIBLE_DEVICES"] = ",".join(self.uuids.get(g.strip(), g.strip()) for g in visible.split(","))
        if name not in self.whole_gpu:
            out["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(share)
        return out

    def stop(self, env: dict[str, str]) -> None:
        exe = shutil.which("nvidia-cuda-mps-control")
        if exe is not None:
            subprocess.run([exe], input=b"quit\n", env={**env, **self.env}, check=False, timeout=30)
