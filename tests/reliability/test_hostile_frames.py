"""Hostile frames on every worker socket of a real CPU cluster: each is logged and dropped, nothing crashes,
nothing leaks, and the cluster still serves the same greedy tokens (GitHub issue 7)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from pdserve.core.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    GenerateCmd,
    HandshakeEvent,
    Sampling,
    decode,
    encode,
    pack_token_ids,
)
from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import greedy_request, stream, tokens_of, wait_blocks_returned
from tests.reliability.report import record

WORKER_FLAGS = ("--num-blocks", "256")
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 19, 23, 31, 2, 77, 101, 12, 9]
ROLES = ("router", "prefill-0", "decode-0")
Frame = list[bytes]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running(tiny_llama_dir, tmp_path_factory.mktemp("run"), 1, 1, *WORKER_FLAGS) as c:
        yield c


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> list[int]:
    """Greedy tokens of PROMPT before any hostile frame."""
    return tokens_of(asyncio.run(stream(cluster.address, greedy_request(PROMPT))))


def pack(version: Any, tag: Any, fields: Any) -> Frame:
    return [msgpack.packb([version, tag, fields], use_bin_type=True)]


def generate_fields(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "request_id": "hostile",
        "token_ids": pack_token_ids([1, 2, 3]),
        "sampling": {"max_tokens": 2},
        "decode_worker": 0,
    }
    return {**fields, **overrides}


def handoff_fields(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "request_id": "hostile-handoff",
        "prefill_worker": 0,
        "pool_id": "no-such-pool",
        "lease_id": 987654,
        "block_ids": [-1, 3],
        "token_ids": pack_token_ids(range(1, 21)),
        "num_prompt_tokens": 19,
        "num_cached_tokens": 0,
        "sampling": {"max_tokens": 2},
        "timings": {},
    }
    return {**fields, **overrides}


def common_frames() -> list[Frame]:
    """Frames every socket must drop, whatever it serves."""
    valid = encode(GenerateCmd("hostile-trunc", pack_token_ids([1, 2, 3]), Sampling(max_tokens=2), 0))
    rng = random.Random(7)
    return [
        [b"a", b"b", b"c"],
        [b""],
        [bytes(rng.randrange(256) for _ in range(200))],
        [valid[: len(valid) // 2]],
        pack(PROTOCOL_VERSION + 1, "generate", generate_fields()),
        pack(PROTOCOL_VERSION, "no_such_type", {}),
        pack(PROTOCOL_VERSION, 7, {}),
        pack(PROTOCOL_VERSION, "abort", {"request_id": "x", "evil": 1}),
        pack(PROTOCOL_VERSION, "abort", "not a dict"),
        [msgpack.packb({"not": "a list"})],
    ]


def prefill_frames() -> list[Frame]:
    v = PROTOCOL_VERSION
    return [
        pack(v, "generate", generate_fields(token_ids="not a list")),
        pack(v, "generate", generate_fields(token_ids=[1, "x", 3])),
        pack(v, "generate", generate_fields(token_ids=[1, 2, 3])),  # a list: not packed
        pack(v, "generate", generate_fields(token_ids=b"\x01\x00\x00")),  # not whole int32s
        pack(v, "generate", generate_fields(token_ids=pack_token_ids([-4, 2]))),
        pack(v, "generate", generate_fields(request_id="hostile-t", timings="not timings")),
        pack(v, "generate", generate_fields(request_id="hostile-d", decode_worker=7)),
        pack(v, "generate", generate_fields(request_id="hostile-s", sampling={"max_tokens": "many"})),
        pack(v, "generate", generate_fields(request_id="hostile-s2", sampling="not sampling")),
        pack(v, "release", {"decode_worker": 0, "lease_ids": [123456, -1], "pool_id": "x"}),
        pack(v, "release", {"decode_worker": 0, "lease_ids": 5, "pool_id": "x"}),
        pack(v, "release", {"decode_worker": 0, "lease_ids": "abc", "pool_id": "x"}),
        pack(v, "abort", {"request_id": ["unhashable"]}),
        pack(v, "decode_lost", {"decode_worker": 42}),
        pack(v, "handoff", handoff_fields()),
    ]


def decode_frames() -> list[Frame]:
    v = PROTOCOL_VERSION
    return [
        pack(v, "handoff", handoff_fields()),  # a pool that does not exist, a negative block id
        pack(v, "handoff", handoff_fields(request_id="hostile-h2", pool_id="x", block_ids=[1000000, 3])),
        pack(v, "handoff", handoff_fields(request_id="hostile-h3", prefill_worker=9)),
        pack(v, "handoff", handoff_fields(request_id="hostile-h4", sampling="not sampling")),
        pack(v, "handoff", handoff_fields(request_id="hostile-h5", token_ids="abc")),
        pack(v, "handoff", handoff_fields(request_id="hostile-h6", block_ids="abc")),
        pack(v, "generate", generate_fields(token_ids="not a list")),
        pack(v, "generate", generate_fields(request_id="hostile-gt", timings="not timings")),
        pack(v, "release", {"decode_worker": 0, "lease_ids": [1], "pool_id": "x"}),
        pack(v, "abort", {"request_id": ["unhashable"]}),
    ]


def router_frames() -> list[Frame]:
    v = PROTOCOL_VERSION
    heartbeat = {
        "role": "evil",
        "worker_id": "x",
        "pid": 1,
        "incarnation": "i",
        "num_free_blocks": 1,
        "num_total_blocks": 1,
        "num_running": 0,
        "num_waiting": 0,
    }
    return [
        pack(v, "tokens", {"request_id": "nobody", "index": 0, "token_ids": [1]}),
        pack(v, "tokens", {"request_id": ["unhashable"], "index": 0, "token_ids": [1]}),
        pack(v, "token_batch", {"events": "not a list"}),
        pack(v, "token_batch", {"events": [{"request_id": "nobody", "index": "x", "token_ids": 3}]}),
        pack(v, "request_error", {"request_id": "nobody", "code": "INTERNAL", "message": "m"}),
        pack(v, "heartbeat", heartbeat),
        pack(v, "heartbeat", {**heartbeat, "role": "decode", "worker_id": 99}),
        pack(v, "kv_snapshot", {"role": "prefill", "worker_id": 0, "incarnation": "i", "seq": -1}),
    ]


def oversized_frame() -> Frame:
    """Just over MAX_MESSAGE_BYTES: the receiving socket's MAXMSGSIZE drops the connection."""
    return pack(PROTOCOL_VERSION, "abort", {"request_id": "x" * (MAX_MESSAGE_BYTES + 1)})


def push_frames(addr: str, frames: list[Frame]) -> None:
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    sock.connect(addr)
    try:
        for parts in frames:
            sock.send_multipart(parts)
    finally:
        sock.close(linger=5000)


def push_oversized(addr: str) -> None:
    """On its own connection: the receiver drops the connection that carried it."""
    push_frames(addr, [oversized_frame()])


def handshake_exchange(addr: str, parts: Frame) -> HandshakeEvent | None:
    """One REQ round trip; the reply, or None when the worker answered nothing within 5 s."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    try:
        sock.send_multipart(parts)
        reply = decode(sock.recv())
    except zmq.Again:
        return None
    finally:
        sock.close()
    assert isinstance(reply, HandshakeEvent)
    return reply


def log_text(cluster: Cluster, role: str) -> str:
    return (cluster.run_dir / "logs" / f"{role}.log").read_text(errors="replace")


def check_still_serving(cluster: Cluster, pids: dict[str, int], reference: list[int]) -> tuple[int, int]:
    """(failures, leaked blocks) after a batch: same pids, same greedy tokens, every block back."""
    failures = 0
    try:
        if tokens_of(asyncio.run(stream(cluster.address, greedy_request(PROMPT)))) != reference:
            failures += 1
    except Exception:
        failures += 1
    failures += sum(pid_now(cluster, role) != pid for role, pid in pids.items())
    try:
        wait_blocks_returned(cluster, timeout=10.0)
        leaked = 0
    except AssertionError:
        leaked = sum(
            cluster.stats(role, 0)["num_total_blocks"] - cluster.stats(role, 0)["num_free_blocks"]
            for role in ("prefill", "decode")
        )
    return failures, leaked


def pid_now(cluster: Cluster, role: str) -> int | None:
    """None while the supervisor restarts role."""
    try:
        return cluster.pid(role)
    except TypeError:
        return None


def pids_of(cluster: Cluster) -> dict[str, int]:
    return {role: cluster.pid(role) for role in ROLES}


@pytest.mark.parametrize(
    ("sock_name", "role", "frames"),
    [
        ("prefill-0.sock", "prefill-0", common_frames() + prefill_frames()),
        ("decode-0.sock", "decode-0", common_frames() + decode_frames()),
        ("router.sock", "router", common_frames() + router_frames()),
    ],
    ids=["prefill-inbox", "decode-inbox", "router-inbox"],
)
def test_hostile_frames_are_dropped_and_the_cluster_keeps_serving(
    cluster: Cluster, reference: list[int], sock_name: str, role: str, frames: list[Frame]
) -> None:
    pids = pids_of(cluster)
    log_before = len(log_text(cluster, role))
    addr = f"ipc://{cluster.run_dir / sock_name}"
    push_frames(addr, frames)
    push_oversized(addr)
    time.sleep(1.0)  # NOTE: let the worker loop drain the batch before checking
    failures, leaked = check_still_serving(cluster, pids, reference)
    record(f"hostile frames -> {sock_name}", len(frames) + 1, failures, leaked, None)
    new_log = log_text(cluster, role)[log_before:]
    assert "dropped a 3-part message" in new_log, cluster.logs()
    assert new_log.count("dropped a bad frame") >= 8, cluster.logs()
    assert (failures, leaked) == (0, 0), cluster.logs()


def test_hostile_handshakes_are_refused_and_the_rep_socket_keeps_answering(
    cluster: Cluster, reference: list[int]
) -> None:
    pids = pids_of(cluster)
    addr = f"ipc://{cluster.run_dir / 'prefill-0.handshake.sock'}"
    v = PROTOCOL_VERSION
    bad: list[Frame] = [
        [b"a", b"b", b"c"],
        [b""],
        [os.urandom(100)],
        pack(v + 1, "handshake", {"decode_worker": 0, "fingerprint": {}}),
        pack(v, "no_such_type", {}),
        pack(v, "generate", generate_fields()),
        pack(v, "handshake", {"decode_worker": 0, "fingerprint": {}, "evil": 1}),
        pack(v, "handshake", {"decode_worker": 0, "fingerprint": "not a dict"}),
        pack(v, "handshake", {"decode_worker": 0, "fingerprint": {"block_size": 3}}),
    ]
    failures = 0
    for parts in bad:
        reply = handshake_exchange(addr, parts)
        if reply is None or reply.ok:  # NOTE: each must get a refusal, so the REP socket is ready for the next
            failures += 1
    f, leaked = check_still_serving(cluster, pids, reference)
    failures += f
    record("hostile frames -> prefill-0.handshake.sock", len(bad), failures, leaked, None)
    assert "refused a handshake" in log_text(cluster, "prefill-0")
    assert (failures, leaked) == (0, 0), cluster.logs()
