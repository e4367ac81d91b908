"""ZeroMQ plumbing shared by the router and the workers: socket paths, sockets, safe receive.

Every process of one cluster lives under one run directory; each receiving socket is bound by its owner:
router.sock (router, PULL), prefill-{i}.sock (prefill worker i, PULL), prefill-{i}.handshake.sock
(prefill worker i, REP), decode-{j}.sock (decode worker j, PULL). Senders connect PUSH sockets.
Each worker also binds {role}-{i}.kv.sock (PUB: its KV cache events), to which the router connects a SUB.

NOTE: no torch here: the router imports this module.
"""

from __future__ import annotations

import logging
from pathlib import Path

import zmq

from core.messages import MAX_MESSAGE_BYTES, Message, MessageError, decode, encode

log = logging.getLogger(__name__)


def router_addr(run_dir: str | Path) -> str:
    return f"ipc://{Path(run_dir) / 'router.sock'}"


def prefill_addr(run_dir: str | Path, worker: int) -> str:
    return f"ipc://{Path(run_dir) / f'prefill-{worker}.sock'}"


def handshake_addr(run_dir: str | Path, worker: int) -> str:
    return f"ipc://{Path(run_dir) / f'prefill-{worker}.handshake.sock'}"


def decode_addr(run_dir: str | Path, worker: int) -> str:
    return f"ipc://{Path(run_dir) / f'decode-{worker}.sock'}"


def kv_events_addr(run_dir: str | Path, role: str, worker: int) -> str:
    return f"ipc://{Path(run_dir) / f'{role}-{worker}.kv.sock'}"


KV_EVENTS_HWM = 10_000
"""Messages a PUB socket queues per subscriber before it drops (the subscriber then sees a seq gap)."""


def bind_pub(ctx: zmq.Context, addr: str, hwm: int = KV_EVENTS_HWM) -> zmq.Socket:
    """PUB: never blocks the sender; a slow or absent subscriber loses messages (LINGER 0, SNDHWM hwm)."""
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock


def bind_pull(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock


def connect_push(ctx: zmq.Context, addr: str) -> zmq.Socket:
    """PUSH that only queues to a live peer (IMMEDIATE): a send to a dead peer fails at once."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RECONNECT_IVL, 20)
    sock.connect(addr)
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
