"""Handshakes that never wait on a worker's step loop: one request, one reply, over ZeroMQ REQ/REP.

- `HandshakeServer` (the answering side, e.g. a prefill worker): a daemon thread owns the REP socket and
  answers each request with `answer(frames)`, which must read only data fixed before the server started
  (layout fingerprint, pool id, transport descriptors), never the engine. So a reply comes within
  milliseconds while the worker's loop is inside a forward pass of seconds (a long prompt on CPU, a CUDA
  graph capture).
- `HandshakeClient` (the asking side, e.g. a decode worker): handshakes in flight, at most one per peer,
  each on its own REQ socket registered with the owner's poller. Nothing blocks: the owner's loop calls
  `collect()` each iteration and gets every handshake that finished (a reply, or a failure once its
  timeout passed), exactly once.

NOTE: a ZeroMQ socket is used by one thread only: the server's socket is made, bound and closed inside its
thread; the client's sockets live in the owner's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import zmq

from pdserve.core import ipc
from pdserve.core.messages import Message, MessageError, decode, encode

log = logging.getLogger(__name__)
SERVER_POLL_MS = 50
"""How often the server's thread looks at its stop flag (the most close() waits for it)."""
BIND_WAIT_S = 10.0
"""How long the constructor waits for the thread to bind (it fails at once on a bad address)."""

Answer = Callable[[list[bytes]], Message]


class HandshakeServer:
    """Answers handshakes on addr from its own thread; start it once everything the answers describe exists."""

    def __init__(self, ctx: zmq.Context, addr: str, answer: Answer, name: str = "handshake") -> None:
        self._ctx = ctx
        self._addr = addr
        self._answer = answer
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._bind_error: zmq.ZMQError | None = None
        self.num_answered = 0
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        if not self._bound.wait(BIND_WAIT_S):
            raise RuntimeError(f"the handshake thread did not bind {addr}")
        if self._bind_error is not None:
            raise self._bind_error

    def _serve(self) -> None:
        sock = self._ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            ipc.bind(sock, self._addr)
        except zmq.ZMQError as exc:
            self._bind_error = exc
            sock.close()
            return
        finally:
            self._bound.set()
        try:
            while not self._stop.is_set():
                if sock.poll(SERVER_POLL_MS):
                    # NOTE: REP answers only once the whole request is read: every part, or the reply fails (EFSM)
                    reply = self._reply(sock.recv_multipart())
                    self.num_answered += 1  # NOTE: before the send: a client holding the reply sees it counted
                    sock.send(reply)
        finally:
            sock.close()

    def _reply(self, frames: list[bytes]) -> bytes:
        try:
            return encode(self._answer(frames))
        except Exception:  # NOTE: the REP socket must answer every request, or it can never receive again
            log.exception("handshake answer failed")
            return b""  # the client reports a bad reply

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * SERVER_POLL_MS / 1000 + 1.0)


class HandshakeResult(NamedTuple):
    """A finished handshake: the peer's reply, or None and why there is none."""

    peer: int
    reply: Message | None
    error: str = ""


class _InFlight(NamedTuple):
    sock: zmq.Socket
    deadline: float


class HandshakeClient:
    """Handshakes in flight, one per peer at most; its sockets sit in the owner's poller, which wakes the owner's
    loop when a reply comes (collect() then takes it)."""

    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, timeout_s: float) -> None:
        self._ctx = ctx
        self._poller = poller
        self.timeout_s = timeout_s
        self._in_flight: dict[int, _InFlight] = {}

    def pending(self, peer: int) -> bool:
        return peer in self._in_flight

    def __len__(self) -> int:
        return len(self._in_flight)

    def start(self, peer: int, addr: str, request: Message) -> None:
        """Send request to peer at addr (a no-op while a handshake with peer is in flight); never blocks."""
        if peer in self._in_flight:
            return
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        ipc.connect(sock, addr)
        # NOTE: REQ queues the request until the peer's socket is there (a peer restarting binds it later)
        sock.send(encode(request), flags=zmq.NOBLOCK)
        self._poller.register(sock, zmq.POLLIN)
        self._in_flight[peer] = _InFlight(sock, time.monotonic() + self.timeout_s)

    def collect(self) -> list[HandshakeResult]:
        """Every handshake that finished since the last call: replied, unreadable, or past its timeout."""
        if not self._in_flight:
            return []
        now = time.monotonic()
        done = []
        for peer, flight in list(self._in_flight.items()):
            result = self._result(peer, flight, now)
            if result is not None:
                self._drop(peer)
                done.append(result)
        return done

    def _result(self, peer: int, flight: _InFlight, now: float) -> HandshakeResult | None:
        try:
            frames = flight.sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            if now < flight.deadline:
                return None
            return HandshakeResult(peer, None, f"no handshake reply from peer {peer} within {self.timeout_s:g} s")
        if len(frames) != 1:
            return HandshakeResult(peer, None, f"a {len(frames)}-part handshake reply")
        try:
            return HandshakeResult(peer, decode(frames[0]))
        except MessageError as exc:
            return HandshakeResult(peer, None, f"bad handshake reply: {exc}")

    def _drop(self, peer: int) -> None:
        sock = self._in_flight.pop(peer).sock
        self._poller.unregister(sock)
        sock.close()

    def close(self) -> None:
        for peer in list(self._in_flight):
            self._drop(peer)
