"""The loop both worker roles share: poll sockets, step the engine, publish KV cache events, heartbeat the router."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import zmq

from pdserve.core import ipc
from pdserve.core.engine import Engine
from pdserve.core.errors import InvalidRequestError
from pdserve.core.frontend_links import FrontendLinks
from pdserve.core.gc_pauses import GcPauses, freeze_startup_heap
from pdserve.core.kv_events import KvEventPublisher, KvOrigin
from pdserve.core.lifecycle import RESTARTS_ENV, process_age_s
from pdserve.core.messages import (
    GenerateCmd,
    HeartbeatEvent,
    KvSnapshotCmd,
    Message,
    RankReadyEvent,
    RequestErrorEvent,
    Sampling,
    Timings,
    unpack_token_ids,
)
from pdserve.core.metrics import WorkerMetrics
from pdserve.core.parallel import close_tp_group
from pdserve.core.rank_group import RankGroup
from pdserve.core.step_timer import StepTimer
from pdserve.kernels.jit_watch import JitWatch

log = logging.getLogger(__name__)
Role = Literal["prefill", "decode"]
PENDING_POLL_MS = 1
"""Poll timeout of an idle loop while has_pending_work(): short, so that work is not held up a heartbeat."""


def bad_fields(cmd: GenerateCmd) -> str | None:
    """Why cmd's fields do not have their types, or None. NOTE: decode() checks field names, not types; a
    request queued with a wrong one would fail later, in the engine step, and take the worker down."""
    if not isinstance(cmd.request_id, str) or type(cmd.decode_worker) is not int:
        return f"request_id {cmd.request_id!r}, decode_worker {cmd.decode_worker!r}"
    if not isinstance(cmd.sampling, Sampling) or not isinstance(cmd.timings, Timings):
        return f"{cmd.request_id}: sampling or timings is not a mapping"
    if unpack_token_ids(cmd.token_ids) is None:
        return f"{cmd.request_id}: token_ids are not packed int32s"
    if type(cmd.sampling.num_generated) is not int:
        return f"{cmd.request_id}: num_generated {cmd.sampling.num_generated!r}"
    return None


class WorkerBase:
    """Owns the ZMQ context, the inbox and the sockets to the front ends (router processes); subclasses handle
    messages and outputs."""

    role: Role

    def __init__(
        self, worker_id: int, run_dir: str, inbox_addr: str, heartbeat_interval: float, group: RankGroup | None = None,
        num_frontends: int = 1,
    ) -> None:  # fmt: skip
        self.worker_id = worker_id
        self.group = group
        """The other ranks of this worker's TP group (None at TP size 1): they run every pass we run."""
        self.run_dir = run_dir
        self.incarnation = uuid.uuid4().hex
        self.ctx = zmq.Context()
        self.inbox = ipc.bind_pull(self.ctx, inbox_addr)
        self.frontends = FrontendLinks(self.ctx, run_dir, num_frontends)
        """One PUSH per front end: a request's events go to the one that owns it (core/frontend_links.py)."""
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        if group is not None:
            self.poller.register(group.events, zmq.POLLIN)
        self.heartbeat_interval = heartbeat_interval
        self.busy_poll_s = 0.0
        """After any work the loop polls without sleeping for this long before it blocks, so a request that
        comes meanwhile finds the process running on a core that never went idle, instead of waking it (at
        the cost of that core). NOTE: for hosts whose workers have cores of their own (a GPU host)."""
        self._last_work = 0.0
        self._stopping = False
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self.engine: Engine  # set by the subclass
        self.kv_events: KvEventPublisher  # bound by run(), once the engine (and so the block size) exists
        self.step_timer = StepTimer()
        self.jit_watch = JitWatch()
        self.jit_watch.install()  # NOTE: before the subclass's warm-up, whose compiles are the expected ones
        self.gc_pauses = GcPauses()
        self.startup_s: dict[str, float] = {}
        """Seconds of each start-up phase, for the ready line (core/worker_main.py fills it)."""
        restarts = int(os.environ.get(RESTARTS_ENV, "0") or 0)
        self.metrics = WorkerMetrics(self.role, worker_id, self.heartbeat_event, restarts)

    def handle(self, msg: Message) -> None:
        raise NotImplementedError

    def _startup_line(self) -> str:
        """' 4.12 s after its process started: imports 2.71 s, weights 0.33 s, ...' (phases of 10 ms or more)."""
        age = process_age_s()
        if age is None:
            return ""
        phases = ", ".join(f"{name} {s:.2f} s" for name, s in self.startup_s.items() if s >= 0.01)
        return f" {age:.2f} s after its process started: {phases}"

    def handle_socket(self, sock: zmq.Socket) -> None:
        """Messages on sockets other than the inbox and the TP ranks' (subclasses register them)."""

    def join_group(self) -> dict[int, RankReadyEvent]:
        """Once our engine is warmed up: wait for the other ranks of the TP group (they built theirs in step with
        ours), then send them every pass. Their ready events by rank ({} at TP size 1)."""
        if self.group is None:
            return {}
        ready = self.group.wait_ready()
        self.engine.runner.lead(self.group.send)
        return ready

    def after_step(self) -> None:
        """Per-iteration housekeeping (lease expiry, retries)."""

    def has_pending_work(self) -> bool:
        """Whether after_step has something to finish soon (e.g. releases of copies in flight): the loop then
        polls every PENDING_POLL_MS instead of idling for a heartbeat interval."""
        return False

    def warm_up(self) -> None:
        """Compile the prefill kernels on CUDA (see ModelRunner.warmup). Subclasses call it once the engine
        exists, before run() starts the heartbeat: the cluster is ready once compiled."""
        if self.engine.runner.device.type == "cuda":
            self.engine.runner.warmup()

    def add_request(self, cmd: GenerateCmd) -> bool:
        """Queue cmd's prompt in the engine; a request it refuses gets INVALID_ARGUMENT at the router."""
        problem = bad_fields(cmd) or (None if self.frontends.valid(cmd.frontend) else f"frontend {cmd.frontend!r}")
        if problem is not None:
            log.warning("dropped a bad GenerateCmd: %s", problem)
            return False
        self.frontends.mark_alive(cmd.frontend)
        try:
            params = cmd.sampling.params
            token_ids = unpack_token_ids(cmd.token_ids)
            assert token_ids is not None  # NOTE: bad_fields checked it
            self.engine.add_request(cmd.request_id, token_ids, params, cmd.sampling.num_generated)
        except InvalidRequestError as exc:
            self.frontends.send(cmd.frontend, RequestErrorEvent(cmd.request_id, "INVALID_ARGUMENT", str(exc)))
            return False
        return True

    def step_engine(self) -> bool:
        """One engine step and its outputs sent on; whether it produced any."""
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        s = self.engine.stats
        return {
            "forward_calls": self.engine.num_forward_calls,
            "prefill_tokens_computed": s.num_prefill_tokens_computed,
            "cached_prompt_tokens": s.num_cached_prompt_tokens,
            "full_hits": s.num_full_hits,
            "preemptions": s.num_preemptions,
            "prompt_tokens": s.num_prompt_tokens,
            "cached_blocks": self.engine.pool.num_cached_blocks,
            "jit_compiles_serving": self.jit_watch.num_compiles_serving,
            **self.step_timer.counters(),
            **self.gc_pauses.counters(),
        }

    def heartbeat_event(self) -> HeartbeatEvent:
        pool, sched = self.engine.pool, self.engine.scheduler
        return HeartbeatEvent(
            role=self.role,
            worker_id=self.worker_id,
            pid=os.getpid(),
            incarnation=self.incarnation,
            num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_blocks - 1,
            num_running=len(sched.running) + self.engine.num_adopted,
            num_waiting=len(sched.waiting),
            counters=self.counters(),
            layout=self.layout_fingerprint(),
            ranks=[os.getpid(), *self.group.pids] if self.group is not None else [],
        )

    def layout_fingerprint(self) -> dict[str, Any]:
        """What must agree between every worker of a cluster (model, dtype, block size, heads, ...)."""
        return {}

    def _heartbeat_loop(self) -> None:
        """Heartbeats to every front end from their own thread and sockets, so a long forward pass never looks
        like a death.

        NOTE: reads the engine's counters without a lock; a structure changing under the read just skips
        one beat.
        """
        links = FrontendLinks(self.ctx, self.run_dir, len(self.frontends))
        while True:
            try:
                event = self.heartbeat_event()
            except RuntimeError:
                event = None
            if event is not None:
                links.broadcast(event, wait_ms=0)
                self._write_stats(event)
            if self._heartbeat_stop.wait(self.heartbeat_interval):
                break
        links.close()

    def _write_stats(self, event: HeartbeatEvent) -> None:
        """The latest heartbeat as JSON under run_dir/stats/ (read by the status command and tests)."""
        path = Path(self.run_dir) / "stats" / f"{self.role}-{self.worker_id}.json"
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(event)))
        tmp.replace(path)

    def run(self) -> None:
        """Serve until SIGTERM / SIGINT."""
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        log.info("%s worker %d ready (pid %d)%s", self.role, self.worker_id, os.getpid(), self._startup_line())
        self.kv_events = self._bind_kv_events()
        self.jit_watch.mark_served()
        log.info("froze %d startup objects out of the garbage collector's scans", freeze_startup_heap(self.gc_pauses))
        self._heartbeat_thread.start()
        while not self._stopping:
            ready = self.poller.poll(self._poll_timeout_ms())
            if ready:
                self._last_work = time.monotonic()
            for sock, _ in ready:
                if sock is self.inbox:
                    for msg in ipc.recv_all(self.inbox):
                        self._safe_handle(msg)
                elif self.group is not None and sock is self.group.events:
                    self.group.handle_events()
                else:
                    self.handle_socket(sock)
            if self.engine.has_unfinished():
                self._last_work = time.monotonic()
                produced = self.step_engine()
                self.engine.flush_commits()  # NOTE: after the outputs went out (see Engine.flush_commits)
                self.step_timer.mark(produced and self.engine.has_unfinished())
            self.after_step()
            self.kv_events.publish(self.engine.pool)
        self.close()

    def _bind_kv_events(self) -> KvEventPublisher:
        """NOTE: bound before the first heartbeat: a worker seen to come up is asked for a snapshot at once."""
        origin = KvOrigin(self.role, self.worker_id, self.incarnation, self.engine.kv.block_size)
        return KvEventPublisher.bind(self.ctx, ipc.kv_events_addr(self.run_dir, self.role, self.worker_id), origin)

    def _poll_timeout_ms(self) -> int:
        if self.engine.has_unfinished() or time.monotonic() - self._last_work < self.busy_poll_s:
            return 0
        return PENDING_POLL_MS if self.has_pending_work() else int(self.heartbeat_interval * 1000)

    def _safe_handle(self, msg: Message) -> None:
        try:
            if isinstance(msg, KvSnapshotCmd):  # NOTE: both roles answer it alike; subclasses never see it
                frontend = msg.frontend if self.frontends.valid(msg.frontend) else 0
                self.frontends.send(frontend, self.kv_events.snapshot(self.engine.pool))
            else:
                self.handle(msg)
        except Exception:  # NOTE: one bad message must not take the worker down
            log.exception("failed to handle %s", type(msg).__name__)

    def _stop(self, *_: object) -> None:
        self._stopping = True

    def close(self) -> None:
        self.jit_watch.uninstall()
        log.info("garbage collector: %s", self.gc_pauses.summary())
        self.gc_pauses.close()
        self._heartbeat_stop.set()
        if self._heartbeat_thread.is_alive():
            self._heartbeat_thread.join(timeout=2.0)
        if self.group is not None:
            self.group.close()
            close_tp_group()
        self.ctx.destroy(linger=0)
