"""core.handshake on its own: the server answers from its thread whatever the caller's thread does, and keeps
answering after an answer that raised; the client never blocks, reports each finished handshake once (a
reply, an unreadable reply, or a timeout), and one handshake per peer is in flight at most."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest
import zmq

from pdserve.core.handshake import HandshakeClient, HandshakeResult, HandshakeServer
from pdserve.core.messages import HandshakeCmd, HandshakeEvent, Message, MessageError, decode

TIMEOUT_S = 0.3
WAIT_S = 3.0


class Env:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="pdhs")
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.client = HandshakeClient(self.ctx, self.poller, TIMEOUT_S)

    def addr(self, name: str) -> str:
        return f"ipc://{self.dir}/{name}.sock"

    def wait(self) -> list[HandshakeResult]:
        """What collect() gives once the poller sees a reply or the timeout passes (what a worker loop does)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            self.poller.poll(10)
            done = self.client.collect()
            if done:
                return done
        raise AssertionError("no handshake finished")


@pytest.fixture
def env() -> Iterator[Env]:
    e = Env()
    try:
        yield e
    finally:
        e.client.close()
        e.ctx.destroy(linger=0)
        shutil.rmtree(e.dir, ignore_errors=True)


def echo_pool(frames: list[bytes]) -> Message:
    msg = decode(frames[0])
    if not isinstance(msg, HandshakeCmd) or msg.decode_worker < 0:
        raise MessageError("not for us")
    return HandshakeEvent(ok=True, pool_id=f"pool-for-{msg.decode_worker}")


def test_reply_comes_back_once_through_collect(env: Env) -> None:
    server = HandshakeServer(env.ctx, env.addr("a"), echo_pool)
    try:
        env.client.start(3, env.addr("a"), HandshakeCmd(7, {}))
        env.client.start(3, env.addr("a"), HandshakeCmd(8, {}))  # in flight already: not sent again
        assert env.client.pending(3) and len(env.client) == 1
        (result,) = env.wait()
        assert result == HandshakeResult(3, HandshakeEvent(ok=True, pool_id="pool-for-7"))
        assert not env.client.pending(3) and env.client.collect() == [] and server.num_answered == 1
    finally:
        server.close()


def test_an_answer_that_raises_gets_an_empty_reply_and_the_server_keeps_answering(env: Env) -> None:
    server = HandshakeServer(env.ctx, env.addr("a"), echo_pool)
    try:
        env.client.start(0, env.addr("a"), HandshakeCmd(-1, {}))
        (failed,) = env.wait()
        assert failed.reply is None and "bad handshake reply" in failed.error
        env.client.start(0, env.addr("a"), HandshakeCmd(2, {}))
        (ok,) = env.wait()
        assert ok.reply == HandshakeEvent(ok=True, pool_id="pool-for-2")
    finally:
        server.close()


def test_no_reply_fails_after_the_timeout_and_a_server_started_later_answers_the_next(env: Env) -> None:
    start = time.monotonic()
    env.client.start(1, env.addr("late"), HandshakeCmd(1, {}))
    assert env.client.collect() == []  # nothing blocks meanwhile
    (result,) = env.wait()
    took = time.monotonic() - start
    assert result.reply is None and "within 0.3 s" in result.error and TIMEOUT_S <= took < TIMEOUT_S + 0.5
    server = HandshakeServer(env.ctx, env.addr("late"), echo_pool)
    try:
        env.client.start(1, env.addr("late"), HandshakeCmd(5, {}))
        (ok,) = env.wait()
        assert ok.reply == HandshakeEvent(ok=True, pool_id="pool-for-5")
    finally:
        server.close()


def test_close_drops_handshakes_in_flight(env: Env) -> None:
    env.client.start(1, env.addr("nobody"), HandshakeCmd(1, {}))
    env.client.close()
    assert not env.client.pending(1) and env.client.collect() == []
