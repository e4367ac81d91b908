"""CURVE on the TCP sockets of a cluster spread over hosts: who may talk to a process, and the log of who tried.

Keys: one server keypair and one client keypair per cluster (ClusterKeys), in a JSON file of mode 0600 that the
launcher writes into each host's run dir. Every bound TCP socket is a CURVE server with the server secret key;
every connecting one a CURVE client with the client keypair and the server public key. Each ZMQ context with a
CURVE server socket runs a ZAP handler (Guard) that admits only the cluster's client public key: knowing the
server public key alone (it is no secret) does not let a peer in.

A peer without the keys never reaches a socket's reader: its handshake fails inside ZMQ, which drops the
connection. The Guard logs it at WARNING, once per peer address (wrong client key, seen by ZAP) or once per
listening endpoint (no CURVE or a wrong server key: ZMQ reports the failure without the peer's address).

NOTE: no torch here: the router imports this module.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

KEYS_FILE = "cluster_keys.json"
"""In a run dir of a cluster over hosts: its ClusterKeys (mode 0600)."""
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "pdserve"
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
POLL_MS = 100
"""How often the Guard's thread looks for sockets to watch that were added meanwhile."""


@dataclass(frozen=True)
class ClusterKeys:
    """The CURVE keys of one cluster (Z85 text, 40 bytes each)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)

    @classmethod
    def make(cls) -> ClusterKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    @classmethod
    def read(cls, path: str | Path) -> ClusterKeys:
        """ValueError naming path when it is missing, unreadable, malformed or readable by others."""
        try:
            if Path(path).stat().st_mode & 0o077:
                raise ValueError("readable by other users (chmod 600 it)")
            raw = json.loads(Path(path).read_text())
            keys = cls(*(raw[name].encode() for name in ("server_public", "server_secret", "client_public",
                                                         "client_secret")))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"cluster keys {path}: {exc}") from None
        if any(len(key) != 40 for key in (keys.server_public, keys.server_secret, keys.client_public,
                                          keys.client_secret)):  # fmt: skip
            raise ValueError(f"cluster keys {path}: each key is 40 characters of Z85")
        return keys

    def write(self, path: str | Path) -> None:
        """Create path (mode 0600); FileExistsError when it exists."""
        text = json.dumps({name: getattr(self, name).decode() for name in
                           ("server_public", "server_secret", "client_public", "client_secret")})  # fmt: skip
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    def serve(self, sock: zmq.Socket) -> None:
        """Make sock (not yet bound) a CURVE server that admits only this cluster's client key."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        Guard.of(sock.context, self.client_public).watch(sock)

    def connect_as_client(self, sock: zmq.Socket) -> None:
        """Make sock (not yet connected) a CURVE client of this cluster's servers."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)


class Guard:
    """The ZAP handler of one ZMQ context, in a thread of its own: admits CURVE clients whose public key is the
    cluster's, refuses every other, and logs refused peers and failed handshakes (socket monitors).

    The thread ends when its context terminates. NOTE: its ZAP socket is bound before of() returns, so no
    handshake on a socket of the context can happen without it (ZMQ admits everyone when no handler is bound)."""

    _lock = threading.Lock()
    _guards: dict[int, Guard] = {}

    def __init__(self, ctx: zmq.Context, client_public: bytes) -> None:
        self.client_key = z85.decode(client_public)
        self._ctx: zmq.Context = zmq.Context.shadow(ctx.underlying)
        self._zap = self._ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        self._watch: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="zmq-curve-guard", daemon=True)
        self._thread.start()

    @classmethod
    def of(cls, ctx: zmq.Context, client_public: bytes) -> Guard:
        """The Guard of ctx's underlying context, started on first use."""
        with cls._lock:
            guard = cls._guards.get(ctx.underlying)
            if guard is None or not guard._thread.is_alive():
                guard = cls._guards[ctx.underlying] = cls(ctx, client_public)
            return guard

    def watch(self, sock: zmq.Socket) -> None:
        """Log the failed handshakes of sock (call before it binds)."""
        endpoint = f"inproc://pdserve.monitor.{id(self)}.{id(sock)}"
        sock.monitor(endpoint, HANDSHAKE_FAILURES)
        self._watch.put(endpoint)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        monitors: list[zmq.Socket] = []
        try:
            while True:
                while not self._watch.empty():
                    monitors.append(self._ctx.socket(zmq.PAIR))
                    monitors[-1].connect(self._watch.get())
                    poller.register(monitors[-1], zmq.POLLIN)
                for sock, _ in poller.poll(POLL_MS):
                    if sock is self._zap:
                        self._zap.send_multipart(self._answer(self._zap.recv_multipart()))
                    else:
                        self._report(recv_monitor_message(sock))
        except zmq.ContextTerminated:
            pass
        finally:
            with Guard._lock:
                if Guard._guards.get(self._ctx.underlying) is self:
                    del Guard._guards[self._ctx.underlying]
            for sock in (self._zap, *monitors):
                with contextlib.suppress(zmq.ZMQError):
                    sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """A ZAP reply (RFC 27): 200 for the cluster's client key over CURVE, 400 for anything else."""
        version, request_id, _domain, address, _identity, mechanism, *credentials = frames
        ok = mechanism == b"CURVE" and credentials[:1] == [self.client_key]
        if not ok:
            self._warn_once(
                address.decode(errors="replace"),
                "refused a ZMQ peer at %s: it is not a client of this cluster (%s without the cluster's client key); "
                "its frames are dropped",
                mechanism.decode(errors="replace"),
            )
        return [version, request_id, b"200" if ok else b"400", b"OK" if ok else b"not a cluster client", b"", b""]

    def _report(self, event: dict) -> None:
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return  # NOTE: ZAP said no and _answer logged it with the peer's address
        endpoint = event["endpoint"].decode(errors="replace")
        self._warn_once(endpoint, "a ZMQ peer failed the CURVE handshake on %s (no CURVE or another cluster's "
                        "server key, error %#x); its frames are dropped", event["value"])  # fmt: skip

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key in self._warned:
            log.debug(message, key, *args)
        else:
            self._warned.add(key)
            log.warning(message, key, *args)
