"""Which prefill worker gets a prompt: the one that has the least work to do for it.

cost(worker) = uncached prompt tokens there + prompt tokens it still has to compute for requests already sent
to it. "Cached" comes from the router's prefix index (KV events the workers publish) and from the prompts
routed to a worker whose events have not arrived yet (PendingPrefixes), so a burst of one prompt lands on one
worker, whose in-flight dedup then prefills it once. Keys are token ids (chained block hashes), never text.

Guard: a mostly cached prompt costs almost nothing by this measure, so a hot prefix could draw every request
to one worker; a worker holding max_queue_skew more queued requests than the least-loaded one is passed over,
except by a prompt it holds whole (a full hit, or a copy of one in flight there): that adds no prefill work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple


class PrefillChoice(NamedTuple):
    worker: int
    uncached_tokens: int
    """Prompt tokens the worker is expected to compute (the router's estimate)."""


class PrefillLoad(NamedTuple):
    """What the router itself knows of one prefill worker's queue."""

    queued_tokens: int
    """Uncached prompt tokens of the requests sent to it that have not produced a token yet."""
    queued_requests: int


def cached_tokens(num_matched: int, num_hashes: int, num_tokens: int, block_size: int) -> int:
    """Prompt tokens covered by num_matched leading hashes of a prompt's hash list (full blocks, then the
    partial tail's hash): all of them once every hash matched, else whole blocks."""
    if num_hashes and num_matched >= num_hashes:
        return num_tokens
    return min(num_matched * block_size, num_tokens)


def choose_prefill_worker(
    up: Iterable[int],
    num_tokens: int,
    cached: Mapping[int, int],
    load: Mapping[int, PrefillLoad],
    max_queue_skew: int,
) -> PrefillChoice | None:
    """The up worker with the least (uncached + queued) tokens; ties go to the longer cached prefix, then the
    lower id. None when no worker is up. cached: worker -> cached prompt tokens there."""
    workers = list(up)
    if not workers:
        return None
    idle = PrefillLoad(0, 0)
    least_queued = min(load.get(w, idle).queued_requests for w in workers)
    eligible = [
        w
        for w in workers
        if cached.get(w, 0) >= num_tokens or load.get(w, idle).queued_requests - least_queued < max_queue_skew
    ]

    def cost(w: int) -> tuple[int, int, int]:
        uncached = num_tokens - cached.get(w, 0)
        return uncached + load.get(w, idle).queued_tokens, -cached.get(w, 0), w

    best = min(eligible, key=cost)
    return PrefillChoice(best, num_tokens - cached.get(best, 0))


class RoundRobin:
    """The baseline policy of the routing benchmark: the next up worker in turn, blind to caches."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, up: Iterable[int]) -> int | None:
        workers = sorted(up)
        if not workers:
            return None
        pick = next((w for w in workers if w >= self._next), workers[0])
        self._next = pick + 1
        return pick


class PendingPrefixes:
    """Block hashes of prompts routed to a prefill worker and not yet reported cached by its KV events.

    NOTE: an entry lives from routing until the request's first token (the worker has computed and cached
    the prompt by then; its KV events take over), or until the request ends.
    """

    def __init__(self) -> None:
        self._requests: dict[str, tuple[int, Sequence[int]]] = {}
        self._holders: dict[int, dict[int, int]] = {}  # hash -> worker -> requests (plain dicts: per request)

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request_id: str, worker: int, hashes: Sequence[int]) -> None:
        self.remove(request_id)
        self._requests[request_id] = (worker, hashes)
        holders = self._holders
        for h in hashes:
            counts = holders.get(h)
            if counts is None:
                holders[h] = {worker: 1}
            else:
                counts[worker] = counts.get(worker, 0) + 1

    def remove(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        worker, hashes = entry
        for h in hashes:
            counts = self._holders[h]
            left = counts[worker] - 1
            if left > 0:
                counts[worker] = left
                continue
            del counts[worker]
            if not counts:
                del self._holders[h]

    def match(self, hashes: Sequence[int]) -> dict[int, int]:
        """worker -> length of the leading run of hashes pending there."""
        if not hashes or hashes[0] not in self._holders:
            return {}
        runs: dict[int, int] = {}
        alive = set(self._holders[hashes[0]])
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            ended = alive - set(holders) if holders else set(alive)
            for w in ended:
                runs[w] = i
            alive -= ended
            if not alive:
                return runs
        runs.update({w: len(hashes) for w in alive})
        return runs
