"""A worker's sockets to several front ends (core/frontend_links.py): a step's TokenEvents leave as one
TokenBatchEvent per front end that owns some of them, to that front end only; heartbeats go to all; a front
end with no live connection is reported."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pdserve.core import ipc
from pdserve.core.frontend_links import FrontendLinks, split_by_frontend
from pdserve.core.messages import HeartbeatEvent, Message, TokenBatchEvent, TokenEvent

QUIET_MS = 100


@pytest.fixture
def run_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="pdfe") as path:  # NOTE: short: ipc:// paths are limited
        yield path


def frames(sock: zmq.Socket, count: int) -> list[Message]:
    """The next count messages, then whatever else comes within QUIET_MS (so extras show)."""
    got: list[Message] = []
    while len(got) < count and sock.poll(2000):
        got += ipc.recv_all(sock)
    while sock.poll(QUIET_MS):
        got += ipc.recv_all(sock)
    return got


def event(request_id: str, index: int) -> TokenEvent:
    return TokenEvent(request_id, index, [index + 10])


def test_front_end_sockets_are_router_sock_then_router_k_sock(run_dir: str) -> None:
    assert ipc.router_addr(run_dir) == ipc.router_addr(run_dir, 0) == f"ipc://{Path(run_dir) / 'router.sock'}"
    assert ipc.router_addr(run_dir, 3) == f"ipc://{Path(run_dir) / 'router-3.sock'}"


def test_split_keeps_each_front_ends_events_in_order() -> None:
    events = [event("a", 0), event("b", 0), event("a", 1), event("x", 0)]
    split = split_by_frontend(events, {"a": 1, "b": 0})
    assert split == {1: [events[0], events[2]], 0: [events[1], events[3]]}


def test_a_batch_for_two_front_ends_goes_out_as_one_frame_to_each(run_dir: str) -> None:
    ctx = zmq.Context()
    try:
        inboxes = [ipc.bind_pull(ctx, ipc.router_addr(run_dir, k)) for k in range(2)]
        links = FrontendLinks(ctx, run_dir, 2)
        events = [event("a", 0), event("b", 3), event("c", 1), event("b", 4)]
        assert links.send_tokens(events, {"a": 1, "b": 0, "c": 1}) == []
        assert frames(inboxes[0], 1) == [TokenBatchEvent([events[1], events[3]])]
        assert frames(inboxes[1], 1) == [TokenBatchEvent([events[0], events[2]])]
        assert links.send_tokens([event("c", 2)], {"c": 1}) == []
        assert frames(inboxes[0], 0) == [] and frames(inboxes[1], 1) == [TokenBatchEvent([event("c", 2)])]
        beat = HeartbeatEvent("decode", 0, 1, "inc", 10, 10, 0, 0)
        links.broadcast(beat)
        assert frames(inboxes[0], 1) == [beat] and frames(inboxes[1], 1) == [beat]
    finally:
        ctx.destroy(linger=0)


def test_a_front_end_with_no_live_connection_is_reported_and_the_others_still_get_theirs(run_dir: str) -> None:
    ctx = zmq.Context()
    try:
        inbox = ipc.bind_pull(ctx, ipc.router_addr(run_dir, 0))  # front end 1 is down
        links = FrontendLinks(ctx, run_dir, 2)
        events = [event("a", 0), event("b", 0)]
        assert links.send_tokens(events, {"a": 0, "b": 1}) == [1]
        assert frames(inbox, 1) == [TokenBatchEvent([events[0]])]
        assert links.valid(1) and not links.valid(2) and not links.valid("1")
    finally:
        ctx.destroy(linger=0)


def test_a_front_end_that_took_nothing_costs_no_wait_until_it_sends_a_command(run_dir: str) -> None:
    ctx = zmq.Context()
    try:
        links = FrontendLinks(ctx, run_dir, 2)
        start = time.monotonic()
        assert links.send_tokens([event("a", 0)], {"a": 1}) == [1]  # waits for a connection once (200 ms)
        waited = time.monotonic() - start
        start = time.monotonic()
        assert links.send_tokens([event("a", 1)], {"a": 1}) == [1] and links.down == {1}
        assert waited >= 0.15 and time.monotonic() - start < 0.05
        inbox = ipc.bind_pull(ctx, ipc.router_addr(run_dir, 1))  # it came back and sent a GenerateCmd
        links.mark_alive(1)
        assert links.send_tokens([event("b", 0)], {"b": 1}) == [] and links.down == set()
        assert frames(inbox, 1) == [TokenBatchEvent([event("b", 0)])]
    finally:
        ctx.destroy(linger=0)
