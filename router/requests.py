"""The router's in-flight requests: which workers hold each one, and the inbox its stream reads."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from core.messages import RequestErrorEvent, TokenEvent
from router.routing import PrefillLoad

InboxItem = TokenEvent | RequestErrorEvent


class DuplicateRequestError(ValueError):
    """A request id that is already in flight."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in flight")


@dataclass(eq=False)
class TrackedRequest:
    """One in-flight request. NOTE: mutated only on the event loop thread."""

    request_id: str
    prefill_worker: int
    decode_worker: int
    inbox: asyncio.Queue[InboxItem] = field(default_factory=asyncio.Queue)
    at_prefill: bool = True
    """No token has arrived yet: the prefill worker still holds it."""
    prefill_tokens: int = 0
    """Prompt tokens the router expects its prefill worker to compute (uncached there at routing time)."""


class RequestTable:
    """Request id -> TrackedRequest, plus per-worker counts for dispatch."""

    def __init__(self) -> None:
        self.requests: dict[str, TrackedRequest] = {}
        self.num_at_prefill: Counter[int] = Counter()
        self.num_at_decode: Counter[int] = Counter()
        self.tokens_at_prefill: Counter[int] = Counter()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def get(self, request_id: str) -> TrackedRequest | None:
        return self.requests.get(request_id)

    def open(self, request_id: str, prefill_worker: int, decode_worker: int, prefill_tokens: int = 0) -> TrackedRequest:
        if request_id in self.requests:
            raise DuplicateRequestError(request_id)
        req = TrackedRequest(request_id, prefill_worker, decode_worker, prefill_tokens=prefill_tokens)
        self.requests[request_id] = req
        self.num_at_prefill[prefill_worker] += 1
        self.tokens_at_prefill[prefill_worker] += prefill_tokens
        self.num_at_decode[decode_worker] += 1
        return req

    def mark_past_prefill(self, req: TrackedRequest) -> None:
        if req.at_prefill:
            req.at_prefill = False
            self.num_at_prefill[req.prefill_worker] -= 1
            self.tokens_at_prefill[req.prefill_worker] -= req.prefill_tokens

    def close(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.mark_past_prefill(req)
        self.num_at_decode[req.decode_worker] -= 1

    def prefill_load(self) -> dict[int, PrefillLoad]:
        """Per prefill worker: prompt tokens to compute and requests not past prefill (the router's own count)."""
        return {w: PrefillLoad(self.tokens_at_prefill[w], n) for w, n in self.num_at_prefill.items()}

    def at_prefill(self, worker: int) -> list[TrackedRequest]:
        """Requests prefill worker `worker` holds (no token seen yet)."""
        return [r for r in self.requests.values() if r.at_prefill and r.prefill_worker == worker]

    def at_decode(self, worker: int) -> list[TrackedRequest]:
        """Requests assigned to decode worker `worker`, whether or not their handoff happened yet."""
        return [r for r in self.requests.values() if r.decode_worker == worker]
