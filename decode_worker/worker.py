"""Decode worker: adopts handed-off requests, pulls their KV blocks, releases them, decodes and streams.

A handed-off request's full blocks that this worker already holds (same chained hashes, e.g. a shared
system prompt) are shared from its prefix cache instead of copied; only the rest are pulled.
NOTE: a pull only enqueues the copy (kvtransfer.base), which runs beside the decode steps and holds none of
them up: the request waits, adopted (its blocks allocated, not scheduled), until the copy is done (polled
every loop iteration; on every rank of a TP group), then decodes, its copied full blocks join the prefix
cache and its lease is released; an abort meanwhile frees its blocks only then. A pull that failed or copied
nothing releases the lease at once.
A handoff from a prefill worker whose pool is not open yet waits, leased and holding none of our blocks, for
the handshake with that pool, which runs in the background (core.handshake) while everything else decodes.

The router may also send GenerateCmd here, in any cluster: always without prefill workers (colocated mode,
the baseline of the benchmarks), and with them when this worker already holds most of the prompt and the
uncached tail is short (conditional disaggregation). The engine then prefills the prompt itself (prefix
cache hits, then chunked, beside the running decodes) and streams every token, the first one included.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict, deque
from typing import Any, NamedTuple

import torch
import zmq

from pdserve.core import ipc
from pdserve.core.config import EngineConfig
from pdserve.core.engine import Adoption, Engine
from pdserve.core.errors import InvalidRequestError
from pdserve.core.handshake import HandshakeClient, HandshakeResult
from pdserve.core.messages import (
    AbortCmd,
    GenerateCmd,
    HandoffCmd,
    HandshakeCmd,
    HandshakeEvent,
    Message,
    RankOpenCmd,
    ReleaseCmd,
    RequestErrorEvent,
    Sampling,
    Timings,
    TokenEvent,
    unpack_block_hashes,
    unpack_token_ids,
)
from pdserve.core.rank_group import RankGroup
from pdserve.core.sampler import SamplingState
from pdserve.core.worker_base import WorkerBase
from pdserve.kvtransfer.base import TRANSPORTS, KVTransferError, KVTransferSink, PullHandle
from pdserve.kvtransfer.factory import AUTO, make_sink
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.pool import KVPool, allocate_kv_pool

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 10.0
"""How long handoffs wait for a prefill worker's handshake reply before they fail (the router migrates them)."""
RECENT_ABORTS = 4096
CLOSE_LINGER_MS = 100
"""How long the releases sent at shutdown may take to leave."""
GROUP_PULL_WAIT_S = 5.0
"""How long a shutdown waits for the other TP ranks' copies of a pull before it leaves the lease to expire."""
CLOSE_SEND_WAIT_MS = 20
"""How long a release at shutdown waits for its prefill worker's connection (a dead one costs this much)."""


class GroupPullHandle:
    """A pull on every rank of our TP group: done once our copy and every other rank's have finished."""

    def __init__(self, local: PullHandle, group: RankGroup, pull_id: int) -> None:
        self.local, self.group, self.pull_id = local, group, pull_id

    def done(self) -> bool:
        return self.local.done() and self.group.pull_done(self.pull_id)

    def wait(self) -> None:
        self.local.wait()
        if not self.group.wait_pull(self.pull_id, GROUP_PULL_WAIT_S):
            raise RuntimeError(f"TP ranks did not finish pull {self.pull_id} within {GROUP_PULL_WAIT_S} s")


class _Copying(NamedTuple):
    """A handoff whose blocks are being copied: once handle is done its request starts (or, aborted meanwhile,
    frees its blocks) and its lease is released."""

    handle: PullHandle | GroupPullHandle
    cmd: HandoffCmd


class StalePoolError(RuntimeError):
    """A handoff names a pool its prefill worker no longer has (it restarted): its blocks and lease are gone."""


def _is_int_list(value: object) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


class DecodeWorker(WorkerBase):
    """One decode process: continuous batching over requests whose prompts were prefilled elsewhere."""

    role = "decode"

    def __init__(
        self,
        cfg: EngineConfig,
        worker_id: int,
        run_dir: str,
        num_prefill: int,
        transport: str,
        heartbeat_interval: float = 0.25,
        group: RankGroup | None = None,
        num_frontends: int = 1,
    ) -> None:
        inbox = ipc.decode_addr(run_dir, worker_id)
        super().__init__(worker_id, run_dir, inbox, heartbeat_interval, group, num_frontends)
        self.cfg = cfg
        self.kv_pool: KVPool | None = None
        self.engine = Engine(cfg, kv_allocator=self._allocate_pool)
        self.warm_up()
        self.join_group()
        self.layout = KVLayout.from_engine_config(cfg, self.engine.runner.num_blocks)
        assert self.kv_pool is not None
        self.transport: str = transport  # one of TRANSPORTS, or AUTO: whatever each prefill worker's descriptor names
        self.sinks: dict[str, KVTransferSink] = {}  # transport -> sink (a forced one now, auto's on first use)
        if transport != AUTO:
            self.sinks[transport] = make_sink(transport, self.kv_pool, self.layout)
        self.sink_of: dict[int, KVTransferSink] = {}  # prefill worker -> the sink its pool is open in
        log.info("KV transport %s, %d blocks of %d tokens", transport, self.layout.num_blocks, self.layout.block_size)
        self.to_prefill: list[zmq.Socket] = [
            ipc.connect_push(self.ctx, ipc.prefill_addr(run_dir, i)) for i in range(num_prefill)
        ]
        self.peers: dict[int, str] = {}  # prefill worker -> pool_id opened
        self.waiting: deque[HandoffCmd] = deque()  # handoffs that found no room yet (still leased)
        self.handshakes: HandshakeClient = HandshakeClient(self.ctx, self.poller, HANDSHAKE_TIMEOUT_S)
        self.held: dict[int, list[HandoffCmd]] = {}  # prefill worker -> its handoffs waiting for our handshake
        self.copying: dict[str, _Copying] = {}  # request -> its adopted handoff whose copy is in flight (leased)
        self.abort_after_copy: set[str] = set()  # requests aborted while copying: freed once the copy is done
        self.num_aborted: int = 0  # requests aborted here: running, waiting, or a handoff that lost the race
        self.aborted: OrderedDict[str, None] = OrderedDict()  # recent aborts, for handoffs that race them
        self.num_blocks_pulled: int = 0  # blocks copied from prefill workers
        self.num_blocks_shared: int = 0  # handed-off blocks found in the local prefix cache instead
        self.timings: dict[str, Timings] = {}  # requests whose first event (it carries these) is not out yet
        self.frontend_of: dict[str, int] = {}
        """Request -> the front end that owns it, for each request in the engine (only with several front ends:
        with one, every event goes to it)."""

    def _allocate_pool(self, num_blocks: int) -> torch.Tensor:
        layout = KVLayout.from_engine_config(self.cfg, num_blocks)
        self.kv_pool = allocate_kv_pool(layout, torch.device(self.cfg.device), shared=False)
        return self.kv_pool.tensor

    def layout_fingerprint(self) -> dict[str, Any]:
        return self.layout.fingerprint()

    def counters(self) -> dict[str, int]:
        return {
            **super().counters(),
            "blocks_pulled": self.num_blocks_pulled,
            "handoff_bytes": self.num_blocks_pulled * self.layout.nbytes // self.layout.num_blocks,
            "aborted": self.num_aborted,
            "blocks_shared": self.num_blocks_shared,
            "handoffs_waiting": len(self.waiting) + sum(map(len, self.held.values())),
            "releases_pending": len(self.copying),
        }

    def handle(self, msg: Message) -> None:
        if isinstance(msg, HandoffCmd):
            problem = self._bad_handoff(msg)
            if problem is not None:
                log.warning("dropped a bad HandoffCmd: %s", problem)
                return
            self.waiting.append(msg)
            self._admit_waiting()
        elif isinstance(msg, GenerateCmd):
            self._generate(msg)
        elif isinstance(msg, AbortCmd):
            self._abort(msg.request_id)
        else:
            log.warning("decode worker ignores %s", type(msg).__name__)

    def _bad_handoff(self, cmd: HandoffCmd) -> str | None:
        """Why cmd's fields do not have their types, or None (decode() checks names, not types)."""
        if type(cmd.prefill_worker) is not int or not 0 <= cmd.prefill_worker < len(self.to_prefill):
            return f"prefill worker {cmd.prefill_worker!r}"
        if not isinstance(cmd.request_id, str) or not isinstance(cmd.pool_id, str) or type(cmd.lease_id) is not int:
            return f"request_id {cmd.request_id!r}, pool_id {cmd.pool_id!r}, lease_id {cmd.lease_id!r}"
        if not self.frontends.valid(cmd.frontend):
            return f"{cmd.request_id}: frontend {cmd.frontend!r}"
        ids = unpack_token_ids(cmd.token_ids)
        if not (_is_int_list(cmd.block_ids) and ids is not None and len(ids) and type(cmd.num_prompt_tokens) is int):
            return f"{cmd.request_id}: block_ids, token_ids or num_prompt_tokens"
        if not isinstance(cmd.sampling, Sampling) or not isinstance(cmd.timings, Timings):
            return f"{cmd.request_id}: sampling or timings is not a mapping"
        hashes = unpack_block_hashes(cmd.block_hashes)
        if hashes is None or len(hashes) not in (0, (len(ids) - 1) // self.cfg.cache.block_size):
            return f"{cmd.request_id}: block_hashes are not one uint64 per full block"
        return None

    def _generate(self, cmd: GenerateCmd) -> None:
        """Prefill (what the prefix cache lacks) and decode the request here."""
        if self.add_request(cmd):
            self.timings[cmd.request_id] = Timings(arrival=cmd.timings.arrival, prefill_start=time.time())
            self._own(cmd.request_id, cmd.frontend)

    def _own(self, request_id: str, frontend: int) -> None:
        if len(self.frontends) > 1:
            self.frontend_of[request_id] = frontend

    def _abort(self, request_id: str) -> None:
        if request_id in self.copying:  # NOTE: the copy still writes its blocks: the engine frees them after it
            known = request_id not in self.abort_after_copy
            self.abort_after_copy.add(request_id)
        else:
            known = self.engine.abort(request_id) is not None
        self.timings.pop(request_id, None)
        self.frontend_of.pop(request_id, None)
        for queue in (self.waiting, *self.held.values()):
            for cmd in [c for c in queue if c.request_id == request_id]:
                queue.remove(cmd)
                self._release(cmd)
                known = True
        self.num_aborted += known
        if known:
            log.info(
                "request %s aborted", request_id
            )  # NOTE: its handoff is here already; remembering the id would drop a later request reusing it
            return
        self.aborted[request_id] = None
        while len(self.aborted) > RECENT_ABORTS:
            self.aborted.popitem(last=False)

    def handle_socket(self, sock: zmq.Socket) -> None:
        self._finish_handshakes()  # NOTE: a handshake reply woke the loop (HandshakeClient's sockets)

    def after_step(self) -> None:
        self._finish_copies()
        self._finish_handshakes()
        self._admit_waiting()

    def has_pending_work(self) -> bool:
        return bool(self.copying)

    def _finish_copies(self) -> None:
        """Start each adopted request whose copy is done (an aborted one: free its blocks) and release its lease
        (NOTE: never earlier: the prefill worker reuses the blocks once released)."""
        for request_id, copying in list(self.copying.items()):
            if copying.handle.done():
                del self.copying[request_id]
                self._copied(copying.cmd)

    def _copied(self, cmd: HandoffCmd) -> None:
        if cmd.request_id in self.abort_after_copy:
            self.abort_after_copy.discard(cmd.request_id)
            self.engine.abort(cmd.request_id)
        else:
            self._start(cmd)
        self._release(cmd)

    def _start(self, cmd: HandoffCmd) -> None:
        """cmd's KV is all here: it decodes from the next step on."""
        self.engine.start_adopted(cmd.request_id)
        now = time.time()
        self.timings[cmd.request_id] = dataclasses.replace(cmd.timings, handoff_end=now)
        if cmd.timings.prefill_end:
            self.metrics.handoff_latency.observe(max(0.0, now - cmd.timings.prefill_end))

    def _admit_waiting(self) -> None:
        while self.waiting:
            cmd = self.waiting[0]
            if cmd.request_id in self.abort_after_copy:  # NOTE: the id is free once that copy is done
                return
            if cmd.request_id in self.aborted:  # NOTE: the one handoff its abort raced; the id is free again
                del self.aborted[cmd.request_id]
                self.num_aborted += 1
                self.waiting.popleft()
                self._release(cmd)
                continue
            if self.peers.get(cmd.prefill_worker) != cmd.pool_id:
                self.waiting.popleft()
                self._hold(cmd)
                continue
            try:
                adopted = self._adopt(cmd)
            except Exception:  # NOTE: a handoff that cannot be adopted must not stay at the head and wedge the loop
                log.exception("dropped handoff %s", cmd.request_id)
                adopted = True
            if not adopted:
                return
            self.waiting.popleft()

    def _adopt(self, cmd: HandoffCmd) -> bool:
        """Adopt cmd and pull the blocks of it we do not hold into our pool (it starts when they are here); False
        if there is no room yet."""
        s = cmd.sampling
        state = SamplingState(s.params, self.cfg.model.eos_token_ids, s.num_generated)
        token_ids, hashes = unpack_token_ids(cmd.token_ids), unpack_block_hashes(cmd.block_hashes)
        assert token_ids is not None and hashes is not None  # NOTE: _bad_handoff checked them
        try:
            dst = self.engine.adopt(cmd.request_id, token_ids, cmd.num_prompt_tokens, state, hashes)
        except InvalidRequestError as exc:
            self._release(cmd)
            self.frontends.send(cmd.frontend, RequestErrorEvent(cmd.request_id, "INTERNAL", str(exc)))
            return True
        if dst is None:
            return False
        try:
            handle = self._pull(cmd, dst)
        except Exception as exc:
            log.exception("KV pull from prefill worker %d failed", cmd.prefill_worker)
            self._settle_copies()  # NOTE: a segment enqueued before the failure may still write the blocks
            self.engine.abort(cmd.request_id)  # NOTE: its blocks were never cached, so no hash keeps garbage
            self._fail_transfer(cmd, exc)
            return True
        self._own(cmd.request_id, cmd.frontend)
        log.info(
            "request %s adopted from prefill %d: pulled=%d shared=%d blocks", cmd.request_id, cmd.prefill_worker,
            len(dst.dst), dst.num_shared,
        )  # fmt: skip
        self.num_blocks_pulled += len(dst.dst)
        self.num_blocks_shared += dst.num_shared
        if handle.done():  # shm: the copy was synchronous; or nothing needed copying
            self._copied(cmd)
        else:
            self.copying[cmd.request_id] = _Copying(handle, cmd)
        return True

    def _settle_copies(self) -> None:
        """Wait for every copy queued on our GPU (a failure path: the blocks of a pull that raised go back)."""
        if self.kv_pool is not None and self.kv_pool.device.type == "cuda":
            torch.cuda.synchronize(self.kv_pool.device)

    def _fail_transfer(self, cmd: HandoffCmd, exc: Exception) -> None:
        """cmd's blocks cannot come here: the router migrates the request; its lease goes back unless stale."""
        error = RequestErrorEvent(cmd.request_id, "UNAVAILABLE", f"KV transfer failed: {exc}")
        self.frontends.send(cmd.frontend, error)
        if not isinstance(exc, StalePoolError):  # NOTE: its lease id may name another lease of the new pool
            self._release(cmd)

    def _pull(self, cmd: HandoffCmd, dst: Adoption) -> PullHandle | GroupPullHandle:
        """Enqueue the copy of the blocks of cmd we do not hold into dst (none: a done handle), on every rank of
        our TP group. NOTE: admitted only once the handshake with cmd's pool is done (_admit_waiting)."""
        if not dst.dst:
            return PullHandle()
        src = dst.sources(cmd.block_ids)
        local = self.sink_of[cmd.prefill_worker].pull(cmd.prefill_worker, src, dst.dst)
        if self.group is None:
            return local
        return GroupPullHandle(local, self.group, self.group.pull(cmd.prefill_worker, src, dst.dst))

    def _release(self, cmd: HandoffCmd, wait_ms: int = 200) -> None:
        ipc.send(self.to_prefill[cmd.prefill_worker], ReleaseCmd(self.worker_id, [cmd.lease_id], cmd.pool_id), wait_ms)

    def close(self) -> None:
        """Wait for the copies in flight (milliseconds) and release their leases before the sockets go; a
        release that is lost anyway is reclaimed by the prefill worker when the lease expires."""
        for copying in self.copying.values():
            try:
                copying.handle.wait()
            except RuntimeError:  # NOTE: a broken CUDA context: leave the lease to expire
                log.exception("waiting for the KV pull of %s failed", copying.cmd.request_id)
                continue
            self._release(copying.cmd, wait_ms=CLOSE_SEND_WAIT_MS)
        self.copying.clear()
        self.handshakes.close()
        for sock in self.to_prefill:
            sock.close(linger=CLOSE_LINGER_MS)
        super().close()

    # --- handshakes: in the background; only the handoffs from that prefill worker wait --------------------
    def _hold(self, cmd: HandoffCmd) -> None:
        """Park cmd (still leased, no blocks of ours yet) until the handshake with its pool is done; start that
        handshake (once per pool: again after the prefill worker restarted) unless it is in flight."""
        prefill_worker = cmd.prefill_worker
        self.held.setdefault(prefill_worker, []).append(cmd)
        if self.handshakes.pending(prefill_worker):
            return
        old = self.sink_of.pop(prefill_worker, None)
        if old is not None:
            old.close(prefill_worker)
        self.peers.pop(prefill_worker, None)
        addr = ipc.handshake_addr(self.run_dir, prefill_worker)
        self.handshakes.start(prefill_worker, addr, HandshakeCmd(self.worker_id, self.layout.fingerprint()))

    def _finish_handshakes(self) -> None:
        """Open the pool of each handshake that finished and queue its held handoffs again (at the front: they
        came first); fail them (the router migrates them) when the handshake or the open failed."""
        for result in self.handshakes.collect():
            held = self.held.pop(result.peer, [])
            try:
                pool_id = self._open_peer(result)
            except Exception as exc:
                log.error("handshake with prefill worker %d failed: %s", result.peer, exc)
                for cmd in held:
                    self._fail_transfer(cmd, exc)
                continue
            ready = []
            for cmd in held:
                if cmd.pool_id == pool_id:
                    ready.append(cmd)
                else:
                    stale = f"the handoff names pool {cmd.pool_id!r}; prefill worker {result.peer} has {pool_id!r}"
                    self._fail_transfer(cmd, StalePoolError(stale))
            self.waiting.extendleft(reversed(ready))

    def _open_peer(self, result: HandshakeResult) -> str:
        """Open the sink a handshake's reply describes; the prefill worker's pool id."""
        reply, prefill_worker = result.reply, result.peer
        if reply is None:
            raise KVTransferError(result.error)
        if not isinstance(reply, HandshakeEvent):
            raise KVTransferError(f"bad handshake reply {type(reply).__name__}")
        if not reply.ok:
            raise KVTransferError(f"prefill worker {prefill_worker} refused the handshake: {reply.error}")
        sink = self._sink(reply.descriptor.get("transport"), prefill_worker)
        sink.open(prefill_worker, reply.descriptor)  # NOTE: checks the descriptor's layout against ours
        if self.group is not None:
            self.group.send(RankOpenCmd(prefill_worker, reply.descriptor))
        self.sink_of[prefill_worker] = sink
        self.peers[prefill_worker] = reply.pool_id
        log.info("KV transport %s with prefill worker %d", sink.transport, prefill_worker)
        return reply.pool_id

    def _sink(self, kind: Any, prefill_worker: int) -> KVTransferSink:
        """The sink of the transport a prefill worker's descriptor names (made on first use)."""
        if kind not in TRANSPORTS or self.transport not in (AUTO, kind):
            raise KVTransferError(f"prefill worker {prefill_worker} offers transport {kind!r}; ours: {self.transport}")
        if kind not in self.sinks:
            assert self.kv_pool is not None
            self.sinks[kind] = make_sink(kind, self.kv_pool, self.layout)
        return self.sinks[kind]

    def step_engine(self) -> bool:
        events = []
        for out in self.engine.step():
            if out.finish_reason is not None:
                log.info(
                    "request %s finished: %s after %d tokens", out.request_id, out.finish_reason, out.num_output_tokens
                )
            index = out.num_output_tokens - len(out.new_token_ids)
            timings = self.timings.pop(out.request_id, None)
            if timings is not None and not timings.prefill_end:  # NOTE: a GenerateCmd: this worker prefilled it
                now = time.time()
                timings = dataclasses.replace(timings, prefill_end=now, first_token=now, handoff_end=now)
            events.append(
                TokenEvent(
                    out.request_id,
                    index,
                    out.new_token_ids,
                    out.finish_reason,
                    out.num_prompt_tokens,
                    out.num_cached_tokens,
                    timings,
                    out.logprobs,
                )
            )
        if events:
            self._send_tokens(events)
        return bool(events)

    def _send_tokens(self, events: list[TokenEvent]) -> None:
        """Each front end its requests' events (one frame each). With several front ends, the requests of one
        that took none (it is gone: its streams went with it) are aborted, so their blocks free at once and the
        next steps do not wait on its socket; with one, they run to their end as before."""
        failed = self.frontends.send_tokens(events, self.frontend_of)
        for event in events:
            if event.finish_reason is not None:
                self.frontend_of.pop(event.request_id, None)
        if not failed or len(self.frontends) == 1:
            return
        lost = [rid for rid, k in self.frontend_of.items() if k in failed]
        log.warning("front ends %s took no tokens: aborting their %d requests", failed, len(lost))
        for request_id in lost:
            self._abort(request_id)
