"""ZeroMQ plumbing shared by the router and the workers: socket paths, sockets, safe receive.

Every process of one cluster lives under one run directory; each receiving socket is bound by its owner:
router.sock (router, PULL; front end k > 0 of several: router-{k}.sock), prefill-{i}.sock (prefill worker i,
PULL), prefill-{i}.handshake.sock (prefill worker i, REP), decode-{j}.sock (decode worker j, PULL). Senders
connect PUSH sockets.
Each worker also binds {role}-{i}.kv.sock (PUB: its KV cache events), to which the router connects a SUB.
A cluster spread over hosts has a topology.json in each host's run dir: the same sockets are then TCP (Topology),
each authenticated with CURVE by the cluster's keys in the same run dir (core/curve.py): bind and connect apply
them to every tcp:// address. ipc:// sockets need no keys: the run dir (0700) keeps other users out.

NOTE: no torch here: the router imports this module.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import zmq

from pdserve.core.curve import KEYS_FILE, ClusterKeys
from pdserve.core.messages import MAX_MESSAGE_BYTES, Message, MessageError, decode, encode

log = logging.getLogger(__name__)


TOPOLOGY_FILE = "topology.json"
"""In a run dir: which host each process of a cluster spread over hosts runs on (see Topology)."""


@dataclass(frozen=True)
class Topology:
    """A cluster over several hosts: every socket is tcp://HOST:PORT instead of an ipc:// path, each process
    binding its own on the host the topology names for it (so binding beyond loopback is explicit, here).

    Ports from base_port: router inbox +0 (front end k: +k, k < 100); prefill i: inbox +100+10i, handshake +1,
    KV events +2; decode j: inbox +5000+10j, KV events +2.
    """

    router: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    base_port: int = 7000

    @classmethod
    def read(cls, path: str | Path) -> Topology:
        """From JSON {"router": host, "prefill": [hosts], "decode": [hosts], "base_port": int}; ValueError."""
        try:
            raw = json.loads(Path(path).read_text())
            topo = cls(str(raw["router"]), tuple(map(str, raw["prefill"])), tuple(map(str, raw["decode"])),
                       int(raw.get("base_port", 7000)))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"bad topology {path}: {exc}") from None
        if not topo.decode or not 1024 <= topo.base_port < 65536 - 5000 - 10 * len(topo.decode):
            raise ValueError(f"bad topology {path}: no decode host or base_port {topo.base_port} out of range")
        return topo

    def host(self, role: str, worker: int = 0) -> str:
        """role's host; every front end (router process) runs on the router host."""
        return self.router if role == "router" else (self.prefill if role == "prefill" else self.decode)[worker]

    def address(self, role: str, worker: int, socket: str) -> str:
        """socket: inbox | handshake | kv."""
        base = {"router": worker, "prefill": 100 + 10 * worker, "decode": 5000 + 10 * worker}[role]
        return f"tcp://{self.host(role, worker)}:{self.base_port + base + SOCKET_OFFSETS[socket]}"

    @property
    def num_hosts(self) -> int:
        return len({self.router, *self.prefill, *self.decode})


SOCKET_OFFSETS = {"inbox": 0, "handshake": 1, "kv": 2}


@functools.cache
def topology(run_dir: str) -> Topology | None:
    """The run dir's topology (None: one host, ipc:// sockets)."""
    path = Path(run_dir) / TOPOLOGY_FILE
    return Topology.read(path) if path.exists() else None


@functools.cache
def cluster_keys(run_dir: str) -> ClusterKeys:
    """The CURVE keys of the run dir's cluster over hosts; ValueError saying how to get them when missing."""
    path = Path(run_dir) / KEYS_FILE
    if not path.exists():
        raise ValueError(f"{path} is missing: a cluster over hosts authenticates its sockets with the keys that "
                         "pdserve-cluster --topology copies there (docs/deployment.md, Security)")  # fmt: skip
    return ClusterKeys.read(path)


_RUN_DIR_OF: dict[str, str] = {}
"""tcp:// address -> the run dir whose topology made it: where its keys are (bind and connect look them up)."""


def _addr(run_dir: str | Path, role: str, worker: int, socket: str, ipc_name: str) -> str:
    topo = topology(str(run_dir))
    if topo is not None:
        addr = topo.address(role, worker, socket)
        _RUN_DIR_OF[addr] = str(run_dir)
        return addr
    return f"ipc://{Path(run_dir) / ipc_name}"


def _keys_of(addr: str) -> ClusterKeys | None:
    """The keys a socket at addr uses: None for ipc://, the cluster's for tcp:// (ValueError when unknown)."""
    if not addr.startswith("tcp://"):
        return None
    if addr not in _RUN_DIR_OF:
        raise ValueError(f"{addr}: a tcp:// address that no run dir's topology made has no keys")
    return cluster_keys(_RUN_DIR_OF[addr])


def bind(sock: zmq.Socket, addr: str) -> None:
    """sock.bind(addr), a CURVE server of the cluster first when addr is tcp://."""
    if (keys := _keys_of(addr)) is not None:
        keys.serve(sock)
    sock.bind(addr)


def connect(sock: zmq.Socket, addr: str) -> None:
    """sock.connect(addr), a CURVE client of the cluster first when addr is tcp://."""
    if (keys := _keys_of(addr)) is not None:
        keys.connect_as_client(sock)
    sock.connect(addr)


def router_addr(run_dir: str | Path, frontend: int = 0) -> str:
    """The inbox of router process (front end) `frontend`; front end 0's is the one router's of a cluster of one."""
    return _addr(run_dir, "router", frontend, "inbox", "router.sock" if frontend == 0 else f"router-{frontend}.sock")


def prefill_addr(run_dir: str | Path, worker: int) -> str:
    return _addr(run_dir, "prefill", worker, "inbox", f"prefill-{worker}.sock")


def handshake_addr(run_dir: str | Path, worker: int) -> str:
    return _addr(run_dir, "prefill", worker, "handshake", f"prefill-{worker}.handshake.sock")


def decode_addr(run_dir: str | Path, worker: int) -> str:
    return _addr(run_dir, "decode", worker, "inbox", f"decode-{worker}.sock")


def kv_events_addr(run_dir: str | Path, role: str, worker: int) -> str:
    return _addr(run_dir, role, worker, "kv", f"{role}-{worker}.kv.sock")


def host_of(run_dir: str | Path, role: str, worker: int) -> str:
    """The host a process binds on: its topology host, or loopback."""
    topo = topology(str(run_dir))
    return "127.0.0.1" if topo is None else topo.host(role, worker)


KV_EVENTS_HWM = 10_000
"""Messages a PUB socket queues per subscriber before it drops (the subscriber then sees a seq gap)."""


def bind_pub(ctx: zmq.Context, addr: str, hwm: int = KV_EVENTS_HWM) -> zmq.Socket:
    """PUB: never blocks the sender; a slow or absent subscriber loses messages (LINGER 0, SNDHWM hwm)."""
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    bind(sock, addr)
    return sock


def bind_pull(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    bind(sock, addr)
    return sock


def connect_push(ctx: zmq.Context, addr: str) -> zmq.Socket:
    """PUSH that only queues to a live peer (IMMEDIATE): a send to a dead peer fails at once."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RECONNECT_IVL, 20)
    connect(sock, addr)
    return sock


def send(sock: zmq.Socket, msg: Message, wait_ms: int = 200) -> bool:
    """Send without queueing for a dead peer; False when no live peer takes it within wait_ms.

    NOTE: the short wait covers a peer that just (re)started and whose connection is still being made.
    """
    frame = encode(msg)
    try:
        sock.send(frame, flags=zmq.NOBLOCK)
        return True
    except zmq.Again:
        pass
    if not sock.poll(wait_ms, zmq.POLLOUT):
        return False
    try:
        sock.send(frame, flags=zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def recv_all(sock: zmq.Socket, limit: int = 1024) -> list[Message]:
    """Every message waiting on sock (up to limit); malformed frames are logged and dropped."""
    out: list[Message] = []
    for _ in range(limit):
        try:
            frames = sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            break
        if len(frames) != 1:
            log.warning("dropped a %d-part message (expected 1)", len(frames))
            continue
        try:
            out.append(decode(frames[0]))
        except MessageError as exc:
            log.warning("dropped a bad frame: %s", exc)
    return out
