"""The router's in-flight requests: which workers hold each one, and the inbox its stream reads.

A request can move (request migration): when a worker that holds it is lost, its stream sends it again as
prompt + the tokens streamed so far to other workers. Each such attempt has its own worker-side request id
(`worker_request_id`), so whatever the lost attempt's workers still send is dropped as unknown.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from pdserve.core.messages import RequestErrorEvent, Sampling, TokenEvent
from pdserve.router.load_table import NUM_AT_DECODE, NUM_AT_PREFILL, RESERVED_AT_DECODE, TOKENS_AT_PREFILL, SharedLoads
from pdserve.router.routing import PrefillLoad


@dataclass(frozen=True)
class WorkerLost:
    """Router-internal inbox item: a worker holding attempt `attempt` of the request went down or restarted."""

    attempt: int
    code: str
    message: str


InboxItem = TokenEvent | RequestErrorEvent | WorkerLost


class DuplicateRequestError(ValueError):
    """A request id that is already in flight."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in flight")


def attempt_id(request_id: str, attempt: int) -> str:
    """The id workers know attempt `attempt` of a request by (the client's id for the first)."""
    return request_id if attempt == 0 else f"{request_id}#migrated-{attempt}"


@dataclass(eq=False)
class TrackedRequest:
    """One in-flight request. NOTE: mutated only on the event loop thread."""

    request_id: str
    prompt_ids: np.ndarray
    """[num_prompt_tokens] int64"""
    sampling: Sampling
    arrival: float
    prefill_worker: int
    decode_worker: int
    inbox: asyncio.Queue[InboxItem] = field(default_factory=asyncio.Queue)
    at_prefill: bool = True
    """No token of this attempt has arrived yet: its prefill worker still holds it."""
    prefill_tokens: int = 0
    """Prompt tokens the router expects its prefill worker to compute (uncached there at routing time)."""
    attempt: int = 0
    """0, then +1 per migration."""
    reserved_blocks: int = 0
    """KV blocks reserved for it at its decode worker (router/admission.py)."""
    decode_started: bool = False
    """A token of the current attempt came from its decode worker: the handoff is done."""

    @property
    def worker_request_id(self) -> str:
        return attempt_id(self.request_id, self.attempt)


class RequestTable:
    """Request id -> TrackedRequest (and worker-side id -> the same), plus per-worker counts for dispatch.

    The counters are this router process's own; with several front ends, each change is also published in this
    front end's row of `shared` (router/load_table.py), and the loads dispatch reads (prefill_load,
    decode_counts, decode_reserved) are the sums over every front end's row.
    """

    def __init__(self, shared: SharedLoads | None = None) -> None:
        self.shared = shared
        self.requests: dict[str, TrackedRequest] = {}
        self.by_worker_id: dict[str, TrackedRequest] = {}
        self.num_at_prefill: Counter[int] = Counter()
        self.num_at_decode: Counter[int] = Counter()
        self.tokens_at_prefill: Counter[int] = Counter()
        self.reserved_at_decode: Counter[int] = Counter()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def get(self, request_id: str) -> TrackedRequest | None:
        return self.requests.get(request_id)

    def by_worker(self, worker_request_id: str) -> TrackedRequest | None:
        """The request whose current attempt workers know by this id (None for a lost attempt's id)."""
        return self.by_worker_id.get(worker_request_id)

    def open(self, request_id: str, prompt_ids: np.ndarray, sampling: Sampling, arrival: float) -> TrackedRequest:
        """A new request, on no worker yet (place it)."""
        if request_id in self.requests:
            raise DuplicateRequestError(request_id)
        req = TrackedRequest(request_id, prompt_ids, sampling, arrival, -1, -1, at_prefill=False)
        self.requests[request_id] = req
        return req

    def place(
        self, req: TrackedRequest, prefill_worker: int, decode_worker: int, prefill_tokens: int = 0,
        reserved_blocks: int = 0,
    ) -> None:  # fmt: skip
        """Put req's current attempt on these workers (unplace it first if it is on others)."""
        req.prefill_worker, req.decode_worker, req.prefill_tokens = prefill_worker, decode_worker, prefill_tokens
        req.at_prefill, req.reserved_blocks, req.decode_started = True, reserved_blocks, False
        self.by_worker_id[req.worker_request_id] = req
        self.num_at_prefill[prefill_worker] += 1
        self.tokens_at_prefill[prefill_worker] += prefill_tokens
        self.num_at_decode[decode_worker] += 1
        self.reserved_at_decode[decode_worker] += reserved_blocks
        self._publish_prefill(prefill_worker)
        self._publish_decode(decode_worker)

    def unplace(self, req: TrackedRequest) -> None:
        """Take req's current attempt off its workers' counts (it is lost, or it ended); once only."""
        if self.by_worker_id.get(req.worker_request_id) is not req:
            return
        del self.by_worker_id[req.worker_request_id]
        self.mark_past_prefill(req)
        self.num_at_decode[req.decode_worker] -= 1
        self.reserved_at_decode[req.decode_worker] -= req.reserved_blocks
        self._publish_decode(req.decode_worker)

    def mark_past_prefill(self, req: TrackedRequest) -> None:
        if req.at_prefill:
            req.at_prefill = False
            self.num_at_prefill[req.prefill_worker] -= 1
            self.tokens_at_prefill[req.prefill_worker] -= req.prefill_tokens
            self._publish_prefill(req.prefill_worker)

    def _publish_prefill(self, worker: int) -> None:
        if self.shared is not None:
            self.shared.write(NUM_AT_PREFILL, worker, self.num_at_prefill[worker])
            self.shared.write(TOKENS_AT_PREFILL, worker, self.tokens_at_prefill[worker])

    def _publish_decode(self, worker: int) -> None:
        if self.shared is not None:
            self.shared.write(NUM_AT_DECODE, worker, self.num_at_decode[worker])
            self.shared.write(RESERVED_AT_DECODE, worker, self.reserved_at_decode[worker])

    def close(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.unplace(req)

    def prefill_load(self) -> dict[int, PrefillLoad]:
        """Per prefill worker: prompt tokens to compute and requests not past prefill (every front end's)."""
        if self.shared is None:
            return {w: PrefillLoad(self.tokens_at_prefill[w], n) for w, n in self.num_at_prefill.items()}
        tokens, nums = self.shared.totals(TOKENS_AT_PREFILL).tolist(), self.shared.totals(NUM_AT_PREFILL).tolist()
        return {w: PrefillLoad(t, n) for w, (t, n) in enumerate(zip(tokens[:-1], nums[:-1], strict=True)) if n}

    def decode_counts(self) -> Mapping[int, int]:
        """Per decode worker: requests assigned to it (every front end's)."""
        return self.num_at_decode if self.shared is None else _by_worker(self.shared.totals(NUM_AT_DECODE))

    def decode_reserved(self) -> Mapping[int, int]:
        """Per decode worker: KV blocks reserved there (every front end's; router/admission.py)."""
        return self.reserved_at_decode if self.shared is None else _by_worker(self.shared.totals(RESERVED_AT_DECODE))

    def awaiting_prefill(self, worker: int) -> list[TrackedRequest]:
        """Requests that still need prefill worker `worker`: not prefilled yet, or prefilled and their handoff
        not confirmed by a token from the decode worker (the HandoffCmd may have died with the worker)."""
        return [r for r in self.requests.values() if r.prefill_worker == worker and not r.decode_started]

    def at_decode(self, worker: int) -> list[TrackedRequest]:
        """Requests assigned to decode worker `worker`, whether or not their handoff happened yet."""
        return [r for r in self.requests.values() if r.decode_worker == worker]


def _by_worker(totals: np.ndarray) -> Counter[int]:
    """[num_slots] column sums as worker -> count (the last slot, COLOCATED's, left out)."""
    return Counter(dict(enumerate(totals[:-1].tolist())))
