"""Prefill worker: batches prompts, samples the first token, leases the blocks to a decode worker."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, NamedTuple

import torch
import zmq

from pdserve.core import ipc
from pdserve.core.config import EngineConfig
from pdserve.core.engine import Engine, RequestOutput
from pdserve.core.handshake import HandshakeServer
from pdserve.core.messages import (
    AbortCmd,
    DecodeWorkerLostCmd,
    GenerateCmd,
    HandoffCmd,
    HandshakeCmd,
    HandshakeEvent,
    Message,
    MessageError,
    ReleaseCmd,
    RequestErrorEvent,
    Sampling,
    Timings,
    TokenEvent,
    decode,
    pack_block_hashes,
    pack_token_ids,
)
from pdserve.core.rank_group import RankGroup
from pdserve.core.worker_base import WorkerBase
from pdserve.kvtransfer.base import KVTransferError, KVTransferSource, merge_descriptors
from pdserve.kvtransfer.factory import AUTO, make_source, pair_transport
from pdserve.kvtransfer.layout import KVLayout, LayoutMismatchError, check_compatible
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.pool import KVPool, allocate_kv_pool, remove_stale_segments

log = logging.getLogger(__name__)


def pair_kinds(transport: str, run_dir: str, worker_id: int, num_decode: int, device: torch.device) -> list[str]:
    """The transport prefill worker worker_id uses with each decode worker (kvtransfer.factory.pair_transport; the
    hosts from the run dir's topology)."""
    host = ipc.host_of(run_dir, "prefill", worker_id)
    return [pair_transport(transport, ipc.host_of(run_dir, "decode", j) == host, device) for j in range(num_decode)]


def source_kinds(transport: str, kinds: list[str]) -> list[str]:
    """The sources every rank of a prefill worker opens: a forced transport's, or under auto each of the pairs'
    kinds (pair_kinds), once."""
    return list(dict.fromkeys([transport] if transport != AUTO else kinds))


class _Pending(NamedTuple):
    decode_worker: int
    arrival: float
    prefill_start: float
    frontend: int
    """The front end that owns the request (GenerateCmd.frontend): its first token goes there."""


class PrefillWorker(WorkerBase):
    """One prefill process. Requests arrive as GenerateCmd; each leaves as a TokenEvent (first token) to the
    router plus a HandoffCmd to its decode worker, whose ReleaseCmd gives the blocks back."""

    role = "prefill"

    def __init__(
        self,
        cfg: EngineConfig,
        worker_id: int,
        run_dir: str,
        num_decode: int,
        transport: str,
        heartbeat_interval: float = 0.25,
        lease_ttl: float = 30.0,
        group: RankGroup | None = None,
        num_frontends: int = 1,
    ) -> None:
        inbox = ipc.prefill_addr(run_dir, worker_id)
        super().__init__(worker_id, run_dir, inbox, heartbeat_interval, group, num_frontends)
        self.transport = transport  # one of TRANSPORTS, or AUTO: per decode worker (kvtransfer.factory.pair_transport)
        self.lease_ttl = lease_ttl
        self.cfg = cfg
        self.host = ipc.host_of(run_dir, "prefill", worker_id)
        self.shared_pool = transport in ("shm", AUTO) and torch.device(cfg.device).type == "cpu"
        if self.shared_pool:
            for name in remove_stale_segments():
                log.info("removed a stale KV segment %s", name)
        self.kv_pool: KVPool | None = None
        # NOTE: a prefill worker hands requests off after their first token: it captures prefill graphs only.
        self.engine = Engine(dataclasses.replace(cfg, capture_decode=False), kv_allocator=self._allocate_pool)
        self.warm_up()
        self.rank_descriptors: list[dict[str, Any]] = [e.descriptors for _, e in sorted(self.join_group().items())]
        """transport -> descriptor of each other rank of our TP group, in rank order."""
        self.layout = KVLayout.from_engine_config(cfg, self.engine.runner.num_blocks)
        assert self.kv_pool is not None
        log.info("KV transport %s, %d blocks of %d tokens", transport, self.layout.num_blocks, self.layout.block_size)
        self.leases: LeaseTable = LeaseTable()
        self.to_decode: list[zmq.Socket] = [
            ipc.connect_push(self.ctx, ipc.decode_addr(run_dir, j)) for j in range(num_decode)
        ]
        self.pending: dict[str, _Pending] = {}
        self.num_aborted: int = 0  # requests finished with reason abort here, before their handoff
        self.num_handoffs: int = 0  # HandoffCmds sent
        # NOTE: every source a decode worker may ask for is opened now, so a handshake is answered from data
        # fixed here (its own thread: a long step must not hold it up); the pool and layout exist by now.
        self.sources: dict[str, KVTransferSource] = {}
        self.source_errors: dict[str, str] = {}  # transport -> why it cannot be opened (refused in handshakes)
        self.pair_kinds: list[str] = pair_kinds(transport, run_dir, worker_id, num_decode, self.kv_pool.device)
        self._open_sources(transport)
        self.fingerprint: dict[str, Any] = self.layout.fingerprint()
        self.handshakes: HandshakeServer = HandshakeServer(
            self.ctx, ipc.handshake_addr(run_dir, worker_id), self._answer_handshake, name="prefill-handshake"
        )

    def _allocate_pool(self, num_blocks: int) -> torch.Tensor:
        layout = KVLayout.from_engine_config(self.cfg, num_blocks)
        self.kv_pool = allocate_kv_pool(layout, torch.device(self.cfg.device), shared=self.shared_pool)
        return self.kv_pool.tensor

    def layout_fingerprint(self) -> dict[str, Any]:
        return self.layout.fingerprint()

    def counters(self) -> dict[str, int]:
        leases = {"leased_blocks": self.leases.num_leased_blocks, "leases": len(self.leases)}
        return {**super().counters(), **leases, "aborted": self.num_aborted, "handoffs": self.num_handoffs}

    # --- messages -------------------------------------------------------------------------------------
    def handle(self, msg: Message) -> None:
        if isinstance(msg, GenerateCmd):
            self._generate(msg)
        elif isinstance(msg, ReleaseCmd):
            if msg.pool_id != self.incarnation:  # NOTE: leases of our previous incarnation: gone with it
                log.info("ignored a release of pool %r (ours is %r)", msg.pool_id, self.incarnation)
                return
            for lease_id in msg.lease_ids:
                self.engine.release_blocks(self.leases.release([lease_id]))
        elif isinstance(msg, AbortCmd):
            if self.pending.pop(msg.request_id, None) is not None:
                self.num_aborted += self.engine.abort(msg.request_id) is not None
                log.info("request %s aborted before its handoff", msg.request_id)
        elif isinstance(msg, DecodeWorkerLostCmd):
            self.engine.release_blocks(self.leases.reclaim(msg.decode_worker))
        else:
            log.warning("prefill worker ignores %s", type(msg).__name__)

    def _generate(self, cmd: GenerateCmd) -> None:
        if type(cmd.decode_worker) is not int or not 0 <= cmd.decode_worker < len(self.to_decode):
            log.warning("dropped a GenerateCmd for decode worker %r", cmd.decode_worker)
            return
        if self.add_request(cmd):
            self.pending[cmd.request_id] = _Pending(cmd.decode_worker, cmd.timings.arrival, time.time(), cmd.frontend)

    # --- handshakes (answered on the HandshakeServer's thread: read only what __init__ fixed) ---------------
    def _open_sources(self, transport: str) -> None:
        """A forced transport must open (a wrong choice fails at start); under auto, a kind that cannot be
        opened, here or on another rank, is refused in the handshakes of the decode workers paired with it."""
        assert self.kv_pool is not None
        for kind in source_kinds(transport, self.pair_kinds):
            try:
                self._check_ranks_export(kind)
                self.sources[kind] = make_source(kind, self.kv_pool, self.host)
            except (RuntimeError, ValueError, OSError) as exc:
                if transport != AUTO:
                    raise
                self.source_errors[kind] = f"cannot open the {kind} KV transport: {exc}"
                log.error("%s", self.source_errors[kind])
                continue
            workers = [j for j, k in enumerate(self.pair_kinds) if k == kind]
            log.info("KV transport %s opened (decode workers %s)", kind, workers)

    def _check_ranks_export(self, kind: str) -> None:
        """KVTransferError unless every other rank of our TP group exported a source of kind."""
        errors = []
        for rank, descriptors in enumerate(self.rank_descriptors, start=1):
            entry = descriptors.get(kind, {"error": "not exported"})
            if "error" in entry:
                errors.append(f"TP rank {rank}: {entry['error']}")
        if errors:
            raise KVTransferError(f"not every rank of the TP group exported it ({'; '.join(errors)})")

    def _answer_handshake(self, frames: list[bytes]) -> HandshakeEvent:
        try:
            if len(frames) != 1:
                raise MessageError(f"a {len(frames)}-part handshake (expected 1)")
            msg = decode(frames[0])
            if not isinstance(msg, HandshakeCmd):
                raise MessageError(f"expected a handshake, got {type(msg).__name__}")
            if not isinstance(msg.fingerprint, dict):
                raise MessageError(f"fingerprint is {type(msg.fingerprint).__name__}, not a mapping")
            check_compatible(self.fingerprint, msg.fingerprint)
            source = self._source_for(msg.decode_worker)
            ranks = [d[source.transport] for d in self.rank_descriptors]
            descriptor = merge_descriptors([source.descriptor(), *ranks]) if ranks else source.descriptor()
            return HandshakeEvent(ok=True, descriptor=descriptor, pool_id=self.incarnation)
        except (MessageError, LayoutMismatchError, KVTransferError) as exc:
            log.error("refused a handshake: %s", exc)
            return HandshakeEvent(ok=False, error=str(exc))

    def _source_for(self, decode_worker: Any) -> KVTransferSource:
        """The source of the transport this worker uses with decode_worker."""
        if type(decode_worker) is not int or not 0 <= decode_worker < len(self.pair_kinds):
            raise MessageError(f"a handshake from unknown decode worker {decode_worker!r}")
        kind = self.pair_kinds[decode_worker]
        if kind in self.source_errors:
            raise KVTransferError(self.source_errors[kind])
        return self.sources[kind]

    # --- engine ---------------------------------------------------------------------------------------
    def step_engine(self) -> bool:
        outputs = self.engine.step()
        # NOTE: every first token goes out before any handoff is built: a burst of hits in one step must not
        # wait on the handoffs (a 1000-token HandoffCmd to encode and send) of the requests before it.
        sent = [(out, self._first_token(out)) for out in outputs]
        self.engine.flush_commits()  # NOTE: the prompts' blocks and rows enter the prefix cache after their tokens left
        for out, (cmd, timings, delivered) in sent:
            if out.finished:
                continue
            if delivered or len(self.frontends) == 1:
                self._hand_off(out, cmd, timings)
            else:  # NOTE: its front end is gone, and its stream with it: no decode worker needs it
                self.num_aborted += self.engine.abort(out.request_id) is not None
                log.warning("request %s aborted: front end %d took no first token", out.request_id, cmd.frontend)
        return bool(outputs)

    def after_step(self) -> None:
        expired = self.leases.expire(time.monotonic())
        if expired:
            log.warning("reclaimed %d blocks of expired leases", len(expired))
            self.engine.release_blocks(expired)

    def _first_token(self, out: RequestOutput) -> tuple[_Pending, Timings, bool]:
        """Send the request's first token to its front end; its pending entry, timings for the handoff and whether
        the front end took it."""
        cmd = self.pending.pop(out.request_id)
        now = time.time()
        timings = Timings(arrival=cmd.arrival, prefill_start=cmd.prefill_start, prefill_end=now, first_token=now)
        delivered = self.frontends.send(
            cmd.frontend,
            TokenEvent(
                out.request_id,
                out.num_output_tokens - len(out.new_token_ids),  # NOTE: > 0 for a migrated request
                out.new_token_ids,
                out.finish_reason,
                out.num_prompt_tokens,
                out.num_cached_tokens,
                timings,
                out.logprobs,
            ),
        )
        if out.finished:
            log.info("request %s finished at prefill: %s", out.request_id, out.finish_reason)
        return cmd, timings, delivered

    def _hand_off(self, out: RequestOutput, cmd: _Pending, timings: Timings) -> None:
        """Lease the request's blocks to its decode worker and send it the HandoffCmd."""
        req = self.engine.detach(out.request_id)
        lease_id = self.leases.grant(req.request_id, cmd.decode_worker, req.block_ids, time.monotonic(), self.lease_ttl)
        handoff = HandoffCmd(
            request_id=req.request_id,
            prefill_worker=self.worker_id,
            pool_id=self.incarnation,
            lease_id=lease_id,
            block_ids=req.block_ids,
            token_ids=pack_token_ids(req.id_array()),
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            sampling=Sampling.of(req.sampling.params, req.sampling.num_generated),
            timings=timings,
            block_hashes=pack_block_hashes(self.engine.computed_block_hashes(req)),
            frontend=cmd.frontend,
        )
        self.num_handoffs += 1
        log.info(
            "request %s prefilled: prompt=%d cached=%d -> decode %d (lease %d, %d blocks)", req.request_id,
            req.num_prompt_tokens, req.num_cached_tokens, cmd.decode_worker, lease_id, len(req.block_ids),
        )  # fmt: skip
        if not ipc.send(self.to_decode[cmd.decode_worker], handoff):
            self.engine.release_blocks(self.leases.release([lease_id]))
            self.frontends.send(
                cmd.frontend,
                RequestErrorEvent(req.request_id, "UNAVAILABLE", f"decode worker {cmd.decode_worker} is not reachable"),
            )

    def close(self) -> None:
        self.handshakes.close()  # NOTE: before the context goes: its thread owns a socket of it
        super().close()
        for source in self.sources.values():
            source.close()
        if self.kv_pool is not None:
            self.kv_pool.close()
