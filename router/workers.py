"""The router's ZeroMQ side: one PULL inbox for every worker's events, one PUSH socket per worker, and worker
liveness from heartbeats (router/liveness.py).

Sockets (core/ipc.py): the router binds ipc://{run_dir}/router.sock (PULL); worker i binds prefill-{i}.sock and
decode worker j binds decode-{j}.sock, which the router connects PUSH sockets to. A worker is up from its
first heartbeat and down after `heartbeat_timeout` seconds without one, or when its incarnation changes (it
restarted). Losing a decode worker fails every request assigned to it and tells every prefill worker to
reclaim its leases; losing a prefill worker fails the requests that have not produced a token yet.

Several front ends (cfg.num_frontends > 1): front end k binds router-{k}.sock; its GenerateCmds name k, so the
workers send those requests' events there, and heartbeats to every front end. Each front end has its own
liveness and prefix index (every worker's KV events reach each SUB), and the load counts of routing and
admission are the sums over all of them (router/load_table.py).

KV cache events: every worker publishes its prefix-cache changes on {role}-{i}.kv.sock (PUB); one SUB socket
here receives them all into `prefix_index` (router/prefix_index.py). A worker is asked for a snapshot
(KvSnapshotCmd; it answers with KvSnapshotEvent in the inbox) when it comes up or restarts, when its batches
show a gap, and again every SNAPSHOT_RETRY_S while it stays out of sync; it is dropped from the index when
it goes down or restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
import zmq
import zmq.asyncio

from pdserve.core import ipc
from pdserve.core.messages import (
    MAX_MESSAGE_BYTES,
    AbortCmd,
    DecodeWorkerLostCmd,
    GenerateCmd,
    HeartbeatEvent,
    KvEventBatchEvent,
    KvSnapshotCmd,
    KvSnapshotEvent,
    Message,
    MessageError,
    RequestErrorEvent,
    Sampling,
    Timings,
    TokenBatchEvent,
    TokenEvent,
    decode,
    pack_token_ids,
)
from pdserve.router.admission import AdmissionQueue, NoRoomError, blocks_needed
from pdserve.router.busy_poll import BusyPoll
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import COLOCATED, Assignment, ClusterView, Dispatcher, NoWorkerError
from pdserve.router.liveness import Change, LayoutMismatch, Liveness, Role, WorkerState
from pdserve.router.load_table import SharedLoads
from pdserve.router.prefix_index import PrefixIndex, WorkerKey
from pdserve.router.requests import DuplicateRequestError, RequestTable, TrackedRequest, WorkerLost, attempt_id

log = logging.getLogger(__name__)
SNAPSHOT_RETRY_S = 1.0
"""A worker out of sync is asked for a snapshot at most this often (the ask or the answer may be lost)."""


class WorkerHub:
    """Owns the sockets, the liveness table and the in-flight request table. NOTE: event-loop thread only."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.actx = zmq.asyncio.Context.shadow(self.ctx)
        self.inbox = _bind_pull(self.actx, ipc.router_addr(cfg.run_dir, cfg.frontend))
        self.to_prefill = [ipc.connect_push(self.ctx, ipc.prefill_addr(cfg.run_dir, i)) for i in range(cfg.num_prefill)]
        self.to_decode = [ipc.connect_push(self.ctx, ipc.decode_addr(cfg.run_dir, j)) for j in range(cfg.num_decode)]
        expected = {"block_size": cfg.block_size} if cfg.block_size else {}
        self.liveness = Liveness(cfg.num_prefill, cfg.num_decode, cfg.heartbeat_timeout, expected)
        self.kv_events = _connect_sub(
            self.actx, [ipc.kv_events_addr(cfg.run_dir, st.role, st.worker_id) for st in self.liveness.all_workers()]
        )
        self.prefix_index = PrefixIndex()
        self.dispatcher = Dispatcher(cfg, self.prefix_index)
        self._refused: dict[tuple[str, int], str] = {}  # (role, worker) -> incarnation refused for its layout
        self._snapshot_asked: dict[WorkerKey, float] = {}  # when each out-of-sync worker was last asked
        self.table = RequestTable(_shared_loads(cfg))
        self.admission = AdmissionQueue(cfg.max_queued)
        self.busy_poll = BusyPoll(cfg.busy_poll_s, lambda: len(self.table))
        self.num_migrations = 0
        self.serving = asyncio.Event()
        self.listeners: list[Callable[[bool], None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.closed = False

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        receivers = [self._receive(), self._receive_kv_events(), self._watch(), self.busy_poll.run()]
        self._tasks = [asyncio.create_task(coro) for coro in receivers]

    async def close(self) -> None:
        self.closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.inbox.close(linger=0)
        self.kv_events.close(linger=0)
        self.ctx.destroy(linger=0)

    # --- requests -------------------------------------------------------------------------------------
    async def admit(self, request_id: str, token_ids: np.ndarray, sampling: Sampling, arrival: float) -> TrackedRequest:
        """submit() once a decode worker has KV room for the request, waiting in the admission queue (FIFO)
        until then; QueueFullError when the queue is full, DuplicateRequestError / NoWorkerError as submit."""
        self.busy_poll.touch()
        if request_id in self.table:
            raise DuplicateRequestError(request_id)
        at_head = False
        if not self.admission:
            try:
                return self.submit(request_id, token_ids, sampling, arrival)
            except NoRoomError:
                pass
        while True:
            await self.admission.wait_turn(at_head)
            try:
                req = self.submit(request_id, token_ids, sampling, arrival)
            except NoRoomError:
                at_head = True
                continue
            except BaseException:
                self.admission.notify()  # NOTE: the turn it had goes to the next one
                raise
            self.admission.notify()  # NOTE: there may be room for the next one too
            return req

    def submit(self, request_id: str, token_ids: np.ndarray, sampling: Sampling, arrival: float) -> TrackedRequest:
        """Pick workers with room and send GenerateCmd; DuplicateRequestError / NoWorkerError / NoRoomError when
        that is impossible now."""
        if request_id in self.table:
            raise DuplicateRequestError(request_id)
        need = self._blocks_needed(len(token_ids), sampling.max_tokens)
        while True:  # NOTE: ends: every failed send takes a worker out until its next heartbeat
            workers = self._assign(request_id, token_ids, need)
            req = self.table.open(request_id, token_ids, sampling, arrival)
            self._place(req, workers, need)
            if self._send_generate(req, token_ids, sampling):
                return req
            self.release(request_id)
            self._unreachable(req)

    def migrate(self, req: TrackedRequest, generated: list[int]) -> None:
        """Start req again on workers that are up: prompt + `generated` (the tokens streamed so far) as the
        prompt, their count as num_generated, so sampling (seeded ones included) and the token indexes carry
        on where they stopped. The lost attempt is aborted wherever it may still be. It was admitted already:
        its KV reservation moves along without a room check. NoWorkerError when a role has no worker up or
        the new first worker cannot be reached."""
        self.abort(req)
        self.dispatcher.forget(req.worker_request_id)
        token_ids = np.concatenate([req.prompt_ids, np.array(generated, dtype=np.int64)])
        workers = self._assign(attempt_id(req.request_id, req.attempt + 1), token_ids, 0)
        self.table.unplace(req)
        req.attempt += 1
        self._place(req, workers, self._blocks_needed(len(req.prompt_ids), req.sampling.max_tokens))
        self.num_migrations += 1
        sampling = dataclasses.replace(req.sampling, num_generated=len(generated))
        if not self._send_generate(req, token_ids, sampling):
            self.table.unplace(req)
            self._unreachable(req)
            raise NoWorkerError(f"{self._first_worker_name(req)} is not reachable")

    def _unreachable(self, req: TrackedRequest) -> None:
        """The worker req's GenerateCmd went to took no connection (a PUSH with IMMEDIATE fails only without
        one): it is dead, whatever its last heartbeat said; down until it heartbeats again."""
        role: Role = "decode" if req.prefill_worker == COLOCATED else "prefill"
        worker = req.decode_worker if role == "decode" else req.prefill_worker
        st = self.liveness.workers[role][worker]
        if st.up:
            st.up = False
            self._apply([Change(role, worker, "down")])

    def _blocks_needed(self, num_tokens: int, max_tokens: int) -> int:
        """KV blocks to reserve at a decode worker; 0 (no admission limit) while the block size is unknown."""
        block_size = self.kv_block_size("decode")
        return blocks_needed(num_tokens, max_tokens, block_size) if block_size else 0

    def _assign(self, worker_request_id: str, token_ids: np.ndarray, need: int) -> Assignment:
        """Workers for a request that needs `need` KV blocks at its decode worker (0: no room check)."""
        live, table = self.liveness, self.table
        decode_up = live.up("decode")
        if need:
            total, reserved = live.total_blocks("decode"), table.decode_reserved()
            decode_up = [j for j in decode_up if reserved[j] + min(need, total[j]) <= total[j]]
            if not decode_up and live.up("decode"):
                raise NoRoomError("no decode worker has KV room for the request now")
        view = ClusterView(
            live.up("prefill"), decode_up, table.prefill_load(), table.decode_counts(), live.free_blocks("decode")
        )
        return self.dispatcher.assign(worker_request_id, token_ids, view)

    def _place(self, req: TrackedRequest, workers: Assignment, need: int) -> None:
        total = self.liveness.total_blocks("decode").get(workers.decode_worker, 0)
        reserved = min(need, total) if total else need
        self.table.place(req, workers.prefill_worker, workers.decode_worker, workers.prefill_tokens, reserved)

    def _send_generate(self, req: TrackedRequest, token_ids: np.ndarray, sampling: Sampling) -> bool:
        """GenerateCmd for req's current attempt to its prefill worker (colocated: its decode worker)."""
        packed = pack_token_ids(token_ids)
        timings = Timings(arrival=req.arrival)
        cmd = GenerateCmd(req.worker_request_id, packed, sampling, req.decode_worker, timings, self.cfg.frontend)
        if req.prefill_worker == COLOCATED:
            return ipc.send(self.to_decode[req.decode_worker], cmd)
        return ipc.send(self.to_prefill[req.prefill_worker], cmd)

    @staticmethod
    def _first_worker_name(req: TrackedRequest) -> str:
        if req.prefill_worker == COLOCATED:
            return f"decode worker {req.decode_worker}"
        return f"prefill worker {req.prefill_worker}"

    def abort(self, req: TrackedRequest) -> None:
        """Tell both workers of req's current attempt to drop it (harmless if either already has; wait_ms=0:
        one of them may be dead)."""
        if self.closed:  # NOTE: streams cancelled at shutdown finish after the sockets are gone
            return
        cmd = AbortCmd(req.worker_request_id)
        if req.prefill_worker != COLOCATED:
            ipc.send(self.to_prefill[req.prefill_worker], cmd, wait_ms=0)
        ipc.send(self.to_decode[req.decode_worker], cmd, wait_ms=0)

    def release(self, request_id: str) -> None:
        req = self.table.get(request_id)
        if req is not None:
            self.dispatcher.forget(req.worker_request_id)
        self.table.close(request_id)
        self.admission.notify()  # NOTE: its KV reservation is free

    # --- inbox ----------------------------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            frames = await self.inbox.recv_multipart()
            if len(frames) != 1:
                log.warning("dropped a %d-part message (expected 1)", len(frames))
                continue
            try:
                self.handle(decode(frames[0]))
            except MessageError as exc:
                log.warning("dropped a bad frame: %s", exc)
            except Exception:  # NOTE: one bad message must not take the router down
                log.exception("failed to handle a worker message")

    def handle(self, msg: Message) -> None:
        if isinstance(msg, HeartbeatEvent):
            self._heartbeat(msg)
        elif isinstance(msg, TokenBatchEvent):
            for event in msg.events:
                self._deliver(event)
        elif isinstance(msg, (TokenEvent, RequestErrorEvent)):
            self._deliver(msg)
        elif isinstance(msg, KvSnapshotEvent):
            self._kv_snapshot(msg)
        else:
            log.warning("router ignores %s", type(msg).__name__)

    def _deliver(self, msg: TokenEvent | RequestErrorEvent) -> None:
        self.busy_poll.touch()
        req = self.table.by_worker(msg.request_id)
        if req is None:  # NOTE: also what a lost attempt's workers still send
            log.debug("dropped %s for unknown request %s", type(msg).__name__, msg.request_id)
            return
        if isinstance(msg, TokenEvent):
            if req.at_prefill:
                self.table.mark_past_prefill(req)
                self.dispatcher.forget(req.worker_request_id)
            elif req.prefill_worker != COLOCATED:
                req.decode_started = True
        req.inbox.put_nowait(msg)

    def _heartbeat(self, hb: HeartbeatEvent) -> None:
        try:
            changes = self.liveness.observe(hb, time.monotonic())
        except LayoutMismatch as exc:
            if self._refused.get((hb.role, hb.worker_id)) != hb.incarnation:  # NOTE: one line per process
                self._refused[(hb.role, hb.worker_id)] = hb.incarnation
                log.error("refused %s", exc)
            return
        except ValueError as exc:
            log.warning("dropped a heartbeat: %s", exc)
            return
        self._apply(changes)

    # --- KV cache events ------------------------------------------------------------------------------
    async def _receive_kv_events(self) -> None:
        while True:
            frames = await self.kv_events.recv_multipart()
            try:
                msg = decode(frames[0]) if len(frames) == 1 else None
                if not isinstance(msg, KvEventBatchEvent):
                    raise MessageError(
                        f"expected a KvEventBatchEvent, got {type(msg).__name__} in {len(frames)} frame(s)"
                    )
                self._kv_batch(msg)
            except MessageError as exc:
                log.warning("dropped a bad KV event frame: %s", exc)
            except Exception:  # NOTE: one bad message must not take the router down
                log.exception("failed to handle a KV event batch")

    def _kv_batch(self, batch: KvEventBatchEvent) -> None:
        key = WorkerKey(batch.role, batch.worker_id)
        if self._known(key) and not self.prefix_index.apply(batch):
            self._ask_snapshot(key, time.monotonic())

    def _kv_snapshot(self, snap: KvSnapshotEvent) -> None:
        key = WorkerKey(snap.role, snap.worker_id)
        if not self._known(key):
            return
        self._snapshot_asked.pop(key, None)
        if not self.prefix_index.apply_snapshot(snap):
            self._ask_snapshot(key, time.monotonic())

    def _ask_snapshot(self, key: WorkerKey, now: float) -> None:
        """KvSnapshotCmd to key, unless it was asked less than SNAPSHOT_RETRY_S ago and has not answered.

        NOTE: wait_ms=0: never stalls the event loop; a lost ask is repeated by _retry_snapshots."""
        asked = self._snapshot_asked.get(key)
        if asked is not None and now - asked < SNAPSHOT_RETRY_S:
            return
        self._snapshot_asked[key] = now
        sock = self.to_prefill[key.worker_id] if key.role == "prefill" else self.to_decode[key.worker_id]
        ipc.send(sock, KvSnapshotCmd(self.cfg.frontend), wait_ms=0)

    def _retry_snapshots(self, now: float) -> None:
        """Ask every up worker the index is not in sync with (NOTE: also one it has heard nothing from: the ask
        on its coming up may have found no connection yet)."""
        for st in self.liveness.all_workers():
            key = WorkerKey(st.role, st.worker_id)
            if st.up and self.prefix_index.synced_seq(key) is None:
                self._ask_snapshot(key, now)

    def _known(self, key: WorkerKey) -> bool:
        if self._worker_state(key) is None:
            log.warning("dropped KV events of unknown worker %r %r", key.role, key.worker_id)
            return False
        return True

    def _worker_state(self, key: WorkerKey) -> WorkerState | None:
        states = self.liveness.workers.get(key.role)  # type: ignore[call-overload]
        return states[key.worker_id] if states is not None and 0 <= key.worker_id < len(states) else None

    def kv_block_size(self, role: Role) -> int | None:
        """The block size role's workers hash prompts with (learned from their KV events, else configured)."""
        return self.prefix_index.block_size(role) or self.cfg.block_size

    # --- liveness -------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        interval = min(0.1, self.cfg.heartbeat_timeout / 4)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            self._apply(self.liveness.expire(now))
            self._retry_snapshots(now)
            if self.admission and self.table.shared is not None:
                self.admission.notify()  # NOTE: room another front end frees shows only in the shared sums

    def _apply(self, changes: list[Change]) -> None:
        for change in changes:
            st = self.liveness.workers[change.role][change.worker_id]
            seen = f" ({st.processes()})" if change.kind != "down" else ""
            log.info("%s worker %d is %s%s", change.role, change.worker_id, change.kind, seen)
            if change.kind != "up":
                self._lost(change.role, change.worker_id, "went down" if change.kind == "down" else "restarted")
            else:
                self.admission.notify()  # NOTE: its KV is room for the queue
            self._kv_change(change)
        serving = self.liveness.serving
        if serving != self.serving.is_set():
            log.info("router is %s", "serving" if serving else "not serving")
            if serving:
                self.serving.set()
            else:
                self.serving.clear()
            for listener in self.listeners:
                listener(serving)

    def _kv_change(self, change: Change) -> None:
        """A worker that went down or restarted leaves the index at once; one that is up (again) is asked for a
        snapshot: batches it published before our SUB connected are lost (the PUB slow joiner)."""
        key = WorkerKey(change.role, change.worker_id)
        self._snapshot_asked.pop(key, None)
        if change.kind != "up":
            self.prefix_index.remove_worker(key)
        if change.kind != "down":
            self._ask_snapshot(key, time.monotonic())

    def _lost(self, role: Role, worker: int, what: str) -> None:
        reqs = self.table.at_decode(worker) if role == "decode" else self.table.awaiting_prefill(worker)
        for req in reqs:
            req.inbox.put_nowait(WorkerLost(req.attempt, "UNAVAILABLE", f"{role} worker {worker} {what}"))
        if role == "decode" and self.cfg.frontend == 0:  # NOTE: one reclaim per loss, as with one front end
            for sock in self.to_prefill:
                ipc.send(sock, DecodeWorkerLostCmd(worker))


def _shared_loads(cfg: RouterConfig) -> SharedLoads | None:
    """This front end's row of the cluster's load table (None with one front end: its own counts are all)."""
    if cfg.num_frontends == 1:
        return None
    return SharedLoads.open(cfg.run_dir, cfg.num_frontends, cfg.frontend, cfg.num_prefill, cfg.num_decode)


def _connect_sub(ctx: zmq.asyncio.Context, addrs: list[str]) -> zmq.asyncio.Socket:
    """One SUB to every worker's PUB (connecting before a worker binds is fine: ZMQ retries)."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 20)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    for addr in addrs:
        ipc.connect(sock, addr)
    return sock


def _bind_pull(ctx: zmq.asyncio.Context, addr: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    ipc.bind(sock, addr)
    return sock
