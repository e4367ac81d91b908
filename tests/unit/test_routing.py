"""The prefill routing policy: least (uncached + queued) tokens, the hot-worker guard, pending prefixes."""

from __future__ import annotations

import random

from pdserve.router.routing import (
    PendingPrefixes,
    PrefillChoice,
    PrefillLoad,
    RoundRobin,
    cached_tokens,
    choose_prefill_worker,
)


def test_request_goes_to_the_worker_with_the_longest_cached_prefix() -> None:
    cached = {0: 160, 1: 960, 2: 480}
    choice = choose_prefill_worker([0, 1, 2], 1000, cached, {}, max_queue_skew=8)
    assert choice == PrefillChoice(1, 40)


def test_queued_tokens_outweigh_a_small_cache_advantage() -> None:
    load = {1: PrefillLoad(queued_tokens=3000, queued_requests=3)}
    choice = choose_prefill_worker([0, 1], 1000, {0: 0, 1: 960}, load, max_queue_skew=8)
    assert choice == PrefillChoice(0, 1000)  # 1000 + 0 < 40 + 3000


def test_ties_go_to_the_longer_cached_prefix_then_the_lower_id() -> None:
    load = {0: PrefillLoad(1000, 1)}
    # worker 0: 0 uncached + 1000 queued; worker 1: 1000 uncached + 0 queued -> tie, 0 has the cache
    assert choose_prefill_worker([0, 1], 1000, {0: 1000}, load, 8) == PrefillChoice(0, 0)
    assert choose_prefill_worker([1, 0], 1000, {}, {}, 8) == PrefillChoice(0, 1000)


def test_a_hot_worker_is_passed_over_once_its_queue_is_skewed() -> None:
    hot = {0: PrefillLoad(queued_tokens=80, queued_requests=8), 1: PrefillLoad(0, 0)}
    assert choose_prefill_worker([0, 1], 500, {0: 490}, hot, max_queue_skew=8) == PrefillChoice(1, 500)
    warm = {0: PrefillLoad(70, 7), 1: PrefillLoad(0, 0)}
    assert choose_prefill_worker([0, 1], 500, {0: 490}, warm, max_queue_skew=8) == PrefillChoice(0, 10)


def test_a_prompt_held_whole_ignores_the_guard() -> None:
    # a full hit (or a copy of a prompt in flight there) adds no prefill work to the hot worker
    hot = {0: PrefillLoad(queued_tokens=500, queued_requests=31), 1: PrefillLoad(0, 0)}
    assert choose_prefill_worker([0, 1], 500, {0: 500}, hot, max_queue_skew=8) == PrefillChoice(0, 0)


def test_no_worker_up_gives_none() -> None:
    assert choose_prefill_worker([], 10, {}, {}, 8) is None
    assert RoundRobin().choose([]) is None


def test_cached_tokens_counts_the_partial_tail_only_on_a_whole_prompt_match() -> None:
    # 40 tokens, block 16: hashes = 2 full blocks + the tail
    assert cached_tokens(0, 3, 40, 16) == 0
    assert cached_tokens(2, 3, 40, 16) == 32
    assert cached_tokens(3, 3, 40, 16) == 40
    assert cached_tokens(2, 2, 32, 16) == 32  # block-aligned: the last full hash is the whole prompt


def test_round_robin_cycles_over_the_workers_that_are_up() -> None:
    rr = RoundRobin()
    assert [rr.choose([0, 1, 2]) for _ in range(4)] == [0, 1, 2, 0]
    assert [rr.choose([0, 2]) for _ in range(3)] == [2, 0, 2]


def test_pending_prefixes_match_the_leading_run_per_worker() -> None:
    pending = PendingPrefixes()
    pending.add("a", 0, [1, 2, 3, 4])
    pending.add("b", 1, [1, 2, 9])
    assert pending.match([1, 2, 3, 7]) == {0: 3, 1: 2}
    assert pending.match([1, 2, 9]) == {0: 2, 1: 3}
    assert pending.match([5, 1]) == {}
    pending.remove("a")
    assert pending.match([1, 2, 3]) == {1: 2}
    pending.remove("b")
    pending.remove("b")  # NOTE: harmless twice
    assert len(pending) == 0 and pending.match([1]) == {}


def test_pending_prefixes_equal_a_brute_force_match() -> None:
    rng = random.Random(0)
    pending = PendingPrefixes()
    truth: dict[str, tuple[int, list[int]]] = {}
    for step in range(400):
        rid = f"r{rng.randrange(30)}"
        if rng.random() < 0.4:
            pending.remove(rid)
            truth.pop(rid, None)
        else:
            hashes = [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
            worker = rng.randrange(3)
            pending.add(rid, worker, hashes)
            truth[rid] = (worker, hashes)
        query = [rng.randrange(6) for _ in range(rng.randrange(1, 7))]
        assert pending.match(query) == _brute_force(truth, query), step


def _brute_force(entries: dict[str, tuple[int, list[int]]], query: list[int]) -> dict[int, int]:
    held: dict[int, set[int]] = {}
    for worker, hashes in entries.values():
        held.setdefault(worker, set()).update(hashes)
    runs = {}
    for worker, hs in held.items():
        n = 0
        while n < len(query) and query[n] in hs:
            n += 1
        if n:
            runs[worker] = n
    return runs
