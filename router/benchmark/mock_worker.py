"""`python -m pdserve.router.benchmark.mock_worker`: a prefill or decode worker without a model, for measuring the
router's own ceiling (scripts/bench_frontend.py): it speaks the real protocol over the real sockets and produces
tokens as fast as it is told to.

- prefill: answers each GenerateCmd at once with its first token (TokenEvent, with timings) and hands the
  request to its decode worker (HandoffCmd: no blocks, no lease; the mock decode worker needs none).
- decode: every step sends one TokenBatchEvent with the next token of every running request, as the real decode
  worker does; a request runs until max_tokens tokens exist (finish_reason "length": ignore_eos is assumed).
  A GenerateCmd (colocated, --prefill 0 at the router) starts a request here with its first token.

Output token k of a request is prompt token k mod the prompt's length: always an id the tokenizer knows.
With `--num-frontends K` each request's events go to the front end its GenerateCmd names (one TokenBatchEvent per
front end a step), heartbeats to all, as the real workers do (core/frontend_links.py).
Heartbeats report `--num-blocks` free blocks of `--block-size`, so the router's KV admission never waits.
NOTE: no torch here; one thread, blocking only in poll() while nothing runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import uuid
from dataclasses import dataclass

import zmq

from pdserve.core import ipc
from pdserve.core.frontend_links import FrontendLinks
from pdserve.core.messages import (
    AbortCmd,
    GenerateCmd,
    HandoffCmd,
    HeartbeatEvent,
    KvSnapshotCmd,
    KvSnapshotEvent,
    Message,
    Sampling,
    Timings,
    TokenEvent,
    pack_token_ids,
    unpack_token_ids,
)

HEARTBEAT_S = 0.2
"""Seconds between heartbeats (the router's default timeout is 2 s)."""


@dataclass(frozen=True)
class MockConfig:
    """One mock worker process."""

    role: str
    """prefill | decode."""
    worker_id: int
    """Its index among the workers of its role."""
    run_dir: str
    """The cluster's run directory (core/ipc.py sockets)."""
    step_s: float = 0.0
    """decode: least time between two steps; 0: step as soon as the last one is sent."""
    block_size: int = 16
    """Reported in heartbeats' layout and KV snapshots."""
    num_blocks: int = 1 << 22
    """Free (and total) blocks every heartbeat reports."""
    num_frontends: int = 1
    """Router processes of the cluster (core/frontend_links.py)."""


@dataclass
class _Running:
    """A request at the mock decode worker: its prompt (the token source), next token index and last index."""

    prompt: list[int]
    next_index: int
    last_index: int
    timings: Timings | None
    frontend: int


class MockWorker:
    """The sockets and the loop of one mock worker. NOTE: the loop's thread owns every socket."""

    def __init__(self, cfg: MockConfig) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        inbox = ipc.prefill_addr if cfg.role == "prefill" else ipc.decode_addr
        self.inbox = ipc.bind_pull(self.ctx, inbox(cfg.run_dir, cfg.worker_id))
        self.frontends = FrontendLinks(self.ctx, cfg.run_dir, cfg.num_frontends)
        self.to_decode: dict[int, zmq.Socket] = {}
        self.incarnation = uuid.uuid4().hex
        self.running: dict[str, _Running] = {}
        self.num_steps = 0

    def run(self) -> None:
        next_heartbeat = next_step = 0.0
        while True:
            now = time.monotonic()
            if now >= next_heartbeat:
                self._heartbeat()
                next_heartbeat = now + HEARTBEAT_S
            due = next_heartbeat if not self.running else max(now, next_step)
            if self.inbox.poll(max(0, int((due - now) * 1e3))):
                for msg in ipc.recv_all(self.inbox):
                    self.handle(msg)
            if self.running and time.monotonic() >= next_step:
                next_step = time.monotonic() + self.cfg.step_s
                self.step()

    def handle(self, msg: Message) -> None:
        if isinstance(msg, GenerateCmd):
            if self.cfg.role == "prefill":
                self._prefill(msg)
            else:
                self._start(msg.request_id, _prompt(msg.token_ids), msg.sampling, msg.timings, msg.frontend, True)
        elif isinstance(msg, HandoffCmd):
            self._start(msg.request_id, _prompt(msg.token_ids), msg.sampling, msg.timings, msg.frontend, False)
        elif isinstance(msg, AbortCmd):
            self.running.pop(msg.request_id, None)
        elif isinstance(msg, KvSnapshotCmd):
            snap = KvSnapshotEvent(self.cfg.role, self.cfg.worker_id, self.incarnation, 0, self.cfg.block_size, [])
            self.frontends.send(msg.frontend, snap)

    def _prefill(self, cmd: GenerateCmd) -> None:
        """The first token to the router, then the request to its decode worker."""
        prompt = _prompt(cmd.token_ids)
        k = cmd.sampling.num_generated  # NOTE: > 0 for a migrated request: prompt holds its k tokens so far
        now = time.time()
        timings = Timings(cmd.timings.arrival, now, now, 0.0, now)
        last = k + 1 >= cmd.sampling.max_tokens
        first = TokenEvent(
            cmd.request_id, k, [prompt[k % len(prompt)]], "length" if last else None, len(prompt) - k, 0, timings
        )
        self.frontends.send(cmd.frontend, first)
        if last:
            return
        ids = prompt + [first.token_ids[0]]
        handoff = HandoffCmd(
            cmd.request_id, self.cfg.worker_id, self.incarnation, 0, [], pack_token_ids(ids), len(prompt), 0,
            dataclasses.replace(cmd.sampling, num_generated=k + 1), timings, frontend=cmd.frontend,
        )  # fmt: skip
        ipc.send(self._decode_socket(cmd.decode_worker), handoff)

    def _decode_socket(self, worker: int) -> zmq.Socket:
        sock = self.to_decode.get(worker)
        if sock is None:
            sock = self.to_decode[worker] = ipc.connect_push(self.ctx, ipc.decode_addr(self.cfg.run_dir, worker))
        return sock

    def _start(
        self, request_id: str, ids: list[int], sampling: Sampling, timings: Timings, frontend: int, first: bool
    ) -> None:
        """A request from a HandoffCmd (ids: prompt + first token) or, colocated, a GenerateCmd (ids: prompt)."""
        num_prompt = len(ids) - (0 if first else 1)
        prompt = ids[:num_prompt] or [0]
        index = sampling.num_generated
        self.running[request_id] = _Running(prompt, index, max(index, sampling.max_tokens - 1), timings, frontend)

    def step(self) -> None:
        """One token for every running request, in one frame."""
        events = []
        frontend_of = {}
        now = time.time()
        for request_id, r in list(self.running.items()):
            done = r.next_index >= r.last_index
            timings = None
            if r.timings is not None:
                timings = dataclasses.replace(r.timings, handoff_end=now, first_token=r.timings.first_token or now)
                r.timings = None
            token = r.prompt[r.next_index % len(r.prompt)]
            events.append(
                TokenEvent(request_id, r.next_index, [token], "length" if done else None, len(r.prompt), 0, timings)
            )
            frontend_of[request_id] = r.frontend
            r.next_index += 1
            if done:
                del self.running[request_id]
        self.frontends.send_tokens(events, frontend_of)
        self.num_steps += 1

    def _heartbeat(self) -> None:
        cfg = self.cfg
        hb = HeartbeatEvent(
            cfg.role, cfg.worker_id, os.getpid(), self.incarnation, cfg.num_blocks, cfg.num_blocks,
            len(self.running), 0, layout={"block_size": cfg.block_size},
        )  # fmt: skip
        self.frontends.broadcast(hb)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _prompt(packed: bytes) -> list[int]:
    ids = unpack_token_ids(packed)
    return [] if ids is None else ids.tolist()


def parse_args(argv: list[str] | None = None) -> MockConfig:
    p = argparse.ArgumentParser(prog="python -m pdserve.router.benchmark.mock_worker", description=__doc__)
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--worker-id", type=int, default=0)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--step-ms", type=float, default=0.0, help="decode: least time between steps (0: none)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1 << 22, help="free blocks every heartbeat reports")
    p.add_argument("--num-frontends", type=int, default=1, help="router processes to send events to")
    args = p.parse_args(argv)
    return MockConfig(args.role, args.worker_id, args.run_dir, args.step_ms / 1e3, args.block_size, args.num_blocks,
                      args.num_frontends)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    worker = MockWorker(parse_args(argv))
    try:
        worker.run()
    except KeyboardInterrupt:
        pass
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
