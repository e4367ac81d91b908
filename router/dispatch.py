"""Which workers get a new request: a prefill worker by routing policy (router/routing.py), a decode worker by
load, or the decode worker alone when it holds all but a short tail of the prompt (conditional disaggregation).

NOTE: keys are token ids (chained block hashes, router/prefix_index.py), never text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from pdserve.core.messages import TokenIds
from pdserve.router.config import RouterConfig
from pdserve.router.prefix_index import PrefixIndex, prompt_block_hashes
from pdserve.router.routing import PendingPrefixes, PrefillLoad, RoundRobin, cached_tokens, choose_prefill_worker


class NoWorkerError(RuntimeError):
    """No prefill or no decode worker is up (gRPC UNAVAILABLE)."""


COLOCATED = -1
"""prefill_worker of a request that its decode worker prefills itself (a cluster without prefill workers, or
conditional disaggregation)."""


class Assignment(NamedTuple):
    prefill_worker: int
    """A prefill worker, or COLOCATED."""
    decode_worker: int
    prefill_tokens: int = 0
    """Prompt tokens the router expects the prefill worker to compute (0 for COLOCATED)."""


class ClusterView(NamedTuple):
    """What the router knows of its workers when a request arrives."""

    prefill_up: Sequence[int]
    decode_up: Sequence[int]
    prefill_load: Mapping[int, PrefillLoad]
    num_at_decode: Mapping[int, int]
    decode_free_blocks: Mapping[int, int]


def choose_decode(up: Iterable[int], num_running: Mapping[int, int], num_free_blocks: Mapping[int, int]) -> int | None:
    """Fewest requests assigned (the router's own count), then most free KV blocks (last heartbeat), then
    the lowest id."""
    return min(up, key=lambda j: (num_running.get(j, 0), -num_free_blocks.get(j, 0), j), default=None)


class Dispatcher:
    """Assigns workers to requests and remembers, until their first token, the prompts routed to each prefill
    worker (PendingPrefixes). NOTE: event-loop thread only."""

    def __init__(self, cfg: RouterConfig, index: PrefixIndex) -> None:
        self.cfg = cfg
        self.index = index
        self.pending = PendingPrefixes()
        self.round_robin = RoundRobin()
        self.num_local_prefills = 0
        """Requests sent straight to a decode worker by conditional disaggregation."""

    def assign(self, request_id: str, token_ids: TokenIds, view: ClusterView) -> Assignment:
        """Workers for a new request; NoWorkerError when a role it needs has none up."""
        decode = choose_decode(view.decode_up, view.num_at_decode, view.decode_free_blocks)
        if decode is None:
            raise NoWorkerError("no decode worker is up")
        if self.cfg.colocated:
            return Assignment(COLOCATED, decode)
        local = self._local_decode_worker(token_ids, view)
        if local is not None:
            self.num_local_prefills += 1
            return Assignment(COLOCATED, local)
        if not view.prefill_up:
            raise NoWorkerError("no prefill worker is up")
        if self.cfg.routing == "round_robin":
            prefill = self.round_robin.choose(view.prefill_up)
            assert prefill is not None
            return Assignment(prefill, decode, len(token_ids))
        return self._route_by_prefix(request_id, token_ids, view, decode)

    def _route_by_prefix(self, request_id: str, token_ids: TokenIds, view: ClusterView, decode: int) -> Assignment:
        block_size = self.index.block_size("prefill") or self.cfg.block_size
        hashes = prompt_block_hashes(token_ids, block_size) if block_size else []
        cached = self._cached_tokens(hashes, len(token_ids), block_size or 0)
        skew = self.cfg.max_queue_skew
        choice = choose_prefill_worker(view.prefill_up, len(token_ids), cached, view.prefill_load, skew)
        assert choice is not None
        if hashes:
            self.pending.add(request_id, choice.worker, hashes)
        return Assignment(choice.worker, decode, choice.uncached_tokens)

    def _cached_tokens(self, hashes: list[int], num_tokens: int, block_size: int) -> dict[int, int]:
        """prefill worker -> prompt tokens it holds or will hold (a prompt routed there and not yet reported)."""
        if not hashes:
            return {}
        matched = self.index.match(hashes, "prefill")
        for worker, n in self.pending.match(hashes).items():
            matched[worker] = max(n, matched.get(worker, 0))
        return {w: cached_tokens(n, len(hashes), num_tokens, block_size) for w, n in matched.items()}

    def _local_decode_worker(self, token_ids: TokenIds, view: ClusterView) -> int | None:
        """Conditional disaggregation: the up decode worker holding the longest prefix of the prompt, if that
        leaves <= local_prefill_threshold tokens to compute and its load is within max_queue_skew of the
        least-loaded one's; None otherwise (or when off)."""
        block_size = self.index.block_size("decode") if self.cfg.conditional_disagg else None
        if not block_size or not view.decode_up:
            return None
        hashes = prompt_block_hashes(token_ids, block_size)
        held = self.index.match(hashes, "decode")
        least = min(view.num_at_decode.get(j, 0) for j in view.decode_up)
        fit = [j for j in view.decode_up if view.num_at_decode.get(j, 0) - least < self.cfg.max_queue_skew]
        best = max(fit, key=lambda j: (held.get(j, 0), -j))
        cached = cached_tokens(held.get(best, 0), len(hashes), len(token_ids), block_size)
        return best if cached > 0 and len(token_ids) - cached <= self.cfg.local_prefill_threshold else None

    def forget(self, request_id: str) -> None:
        """The request's prompt is computed (its first token arrived) or it ended: its KV events take over."""
        self.pending.remove(request_id)
