"""A worker's sockets to the router processes (front ends) of its cluster: one PUSH per front end.

A request's TokenEvents and RequestErrorEvents go to the one front end that owns it (GenerateCmd.frontend,
carried on by HandoffCmd.frontend); what concerns the whole worker (heartbeats) goes to every front end; a KV
snapshot goes to the front end that asked for it. With one front end this is the one router socket.

NOTE: no torch here (the mock workers of the front-end benchmark use it too). A FrontendLinks belongs to one
thread: the heartbeat thread makes its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import zmq

from pdserve.core import ipc
from pdserve.core.messages import Message, TokenBatchEvent, TokenEvent

log = logging.getLogger(__name__)


def split_by_frontend(events: Iterable[TokenEvent], frontend_of: Mapping[str, int]) -> dict[int, list[TokenEvent]]:
    """events grouped by the front end of their request, in their order (a request unknown here: front end 0)."""
    out: dict[int, list[TokenEvent]] = {}
    for event in events:
        out.setdefault(frontend_of.get(event.request_id, 0), []).append(event)
    return out


class FrontendLinks:
    """PUSH sockets to front ends 0..num_frontends-1 (core/ipc.py router_addr)."""

    def __init__(self, ctx: zmq.Context, run_dir: str, num_frontends: int) -> None:
        self.sockets = [ipc.connect_push(ctx, ipc.router_addr(run_dir, k)) for k in range(num_frontends)]
        self.down: set[int] = set()
        """Front ends whose last send failed: sends to them do not wait for a connection (one that restarted
        and connected again takes them at once), so a dead one costs no step a wait per message."""

    def __len__(self) -> int:
        return len(self.sockets)

    def valid(self, frontend: object) -> bool:
        return type(frontend) is int and 0 <= frontend < len(self.sockets)

    def send(self, frontend: int, msg: Message, wait_ms: int = 200) -> bool:
        """msg to one front end (ipc.send); False when it has no live connection (it is down or restarting)."""
        ok = ipc.send(self.sockets[frontend], msg, 0 if frontend in self.down else wait_ms)
        if ok:
            self.down.discard(frontend)
        elif len(self.sockets) > 1:
            self.down.add(frontend)
        return ok

    def mark_alive(self, frontend: int) -> None:
        """frontend just sent us a command: its connection may still be on its way, so sends wait for it again."""
        self.down.discard(frontend)

    def broadcast(self, msg: Message, wait_ms: int = 200) -> None:
        """msg to every front end (a dead one misses it)."""
        for sock in self.sockets:
            ipc.send(sock, msg, wait_ms)

    def send_tokens(self, events: list[TokenEvent], frontend_of: Mapping[str, int]) -> list[int]:
        """One TokenBatchEvent per front end holding its requests' events; the front ends that took none."""
        if len(self.sockets) == 1:
            return [] if self.send(0, TokenBatchEvent(events)) else [0]
        return [k for k, batch in split_by_frontend(events, frontend_of).items()
                if not self.send(k, TokenBatchEvent(batch))]  # fmt: skip

    def close(self, linger: int = 0) -> None:
        for sock in self.sockets:
            sock.close(linger=linger)
