"""router.liveness.Liveness and router.dispatch: who is up, and which worker gets the next request."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pdserve.core.messages import HeartbeatEvent, KvSnapshotEvent, Sampling
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import COLOCATED, Assignment, ClusterView, Dispatcher, NoWorkerError, choose_decode
from pdserve.router.liveness import Change, LayoutMismatch, Liveness
from pdserve.router.prefix_index import PrefixIndex, prompt_block_hashes
from pdserve.router.requests import DuplicateRequestError, RequestTable
from pdserve.router.routing import PrefillLoad


def hb(role: str, worker: int, incarnation: str = "a", free: int = 10) -> HeartbeatEvent:
    return HeartbeatEvent(role, worker, 1, incarnation, free, 16, 0, 0)


def test_worker_is_up_from_its_first_heartbeat_and_down_after_the_timeout() -> None:
    live = Liveness(num_prefill=1, num_decode=2, timeout=2.0)
    assert not live.serving and live.up("decode") == []
    assert live.observe(hb("prefill", 0), now=0.0) == [Change("prefill", 0, "up")]
    assert live.observe(hb("decode", 1), now=0.5) == [Change("decode", 1, "up")]
    assert live.observe(hb("decode", 1), now=1.0) == []
    assert live.serving and live.up("decode") == [1]
    assert live.expire(now=2.1) == [Change("prefill", 0, "down")]
    assert not live.serving
    assert live.expire(now=3.1) == [Change("decode", 1, "down")]
    assert live.expire(now=9.0) == []


def test_new_incarnation_is_a_restart() -> None:
    live = Liveness(1, 1, timeout=2.0)
    live.observe(hb("decode", 0, "a"), now=0.0)
    assert live.observe(hb("decode", 0, "b"), now=0.1) == [Change("decode", 0, "restarted")]
    assert live.up("decode") == [0]


@pytest.mark.parametrize("beat", [hb("prefill", 1), hb("decode", -1), hb("router", 0)])
def test_heartbeat_from_an_unknown_worker_is_refused(beat: HeartbeatEvent) -> None:
    with pytest.raises(ValueError, match="unknown worker"):
        Liveness(1, 1, timeout=2.0).observe(beat, now=0.0)


def test_a_worker_with_another_kv_layout_never_counts_as_up() -> None:
    live = Liveness(1, 2, timeout=2.0, expected_layout={"block_size": 16})
    layout = {"model": "m", "dtype": "float32", "block_size": 16, "num_kv_heads": 2}

    def beat(role: str, worker: int, **changes: object) -> HeartbeatEvent:
        return dataclasses.replace(hb(role, worker), layout={**layout, **changes})

    with pytest.raises(LayoutMismatch, match="block_size 16 != 32"):  # the configured field, before any pin
        live.observe(beat("decode", 1, block_size=32), now=0.0)
    assert live.observe(beat("prefill", 0), now=0.0) == [Change("prefill", 0, "up")]  # pins the rest
    with pytest.raises(LayoutMismatch, match="dtype float32 != bfloat16"):
        live.observe(beat("decode", 0, dtype="bfloat16"), now=0.1)
    assert live.observe(beat("decode", 0), now=0.2) == [Change("decode", 0, "up")]
    assert live.up("decode") == [0] and live.observe(hb("decode", 1), now=0.3)  # no layout: an older worker


def test_decode_choice_is_fewest_running_then_most_free_blocks_then_lowest_id() -> None:
    assert choose_decode([0, 1], {0: 3, 1: 1}, {0: 100, 1: 5}) == 1
    assert choose_decode([0, 1, 2], {}, {0: 5, 1: 50, 2: 50}) == 1
    assert choose_decode([1], {0: 0}, {}) == 1


BS = 4
PROMPT = list(range(100, 126))  # 6 full blocks of 4 + a 2-token tail


def view(prefill_up: list[int], decode_up: list[int], load: dict[int, PrefillLoad] | None = None) -> ClusterView:
    return ClusterView(prefill_up, decode_up, load or {}, {}, {})


def dispatcher(**cfg: object) -> Dispatcher:
    return Dispatcher(RouterConfig("m", "r", num_prefill=2, num_decode=2, **cfg), PrefixIndex())  # type: ignore[arg-type]


def holds(d: Dispatcher, role: str, worker: int, token_ids: list[int]) -> None:
    """The worker reports (a snapshot) that it caches token_ids' blocks."""
    snap = KvSnapshotEvent(role, worker, "inc", 0, BS, prompt_block_hashes(token_ids, BS))
    assert d.index.apply_snapshot(snap)


def test_assignment_needs_a_worker_of_each_role_up() -> None:
    d = dispatcher()
    assert d.assign("a", PROMPT, view([0], [1])) == Assignment(0, 1, len(PROMPT))
    with pytest.raises(NoWorkerError, match="prefill"):
        d.assign("b", PROMPT, view([], [0]))
    with pytest.raises(NoWorkerError, match="decode"):
        d.assign("c", PROMPT, view([0], []))


def test_routing_sends_a_request_to_the_worker_with_the_longest_cached_prefix() -> None:
    d = dispatcher()
    holds(d, "prefill", 0, PROMPT[:8])
    holds(d, "prefill", 1, PROMPT[:20])
    assert d.assign("a", PROMPT, view([0, 1], [0])) == Assignment(1, 0, len(PROMPT) - 20)
    # a worker that is down is not a candidate, whatever it holds
    assert d.assign("b", PROMPT + [7], view([0], [0])) == Assignment(0, 0, len(PROMPT) + 1 - 8)


def test_a_burst_of_one_prompt_lands_on_one_prefill_worker() -> None:
    d = dispatcher(block_size=BS)  # NOTE: no worker has reported yet: the configured block size
    load: dict[int, PrefillLoad] = {}
    for i in range(12):
        a = d.assign(f"r{i}", PROMPT, view([0, 1], [0], load))
        assert a.prefill_worker == 0 and a.prefill_tokens == (len(PROMPT) if i == 0 else 0)
        prev = load.get(0, PrefillLoad(0, 0))
        load[0] = PrefillLoad(prev.queued_tokens + a.prefill_tokens, prev.queued_requests + 1)
    d.forget("r0")  # NOTE: its first token came: worker 0's KV events take over
    assert len(d.pending) == 11


def test_round_robin_ignores_the_prefix_cache() -> None:
    d = dispatcher(routing="round_robin")
    holds(d, "prefill", 0, PROMPT)
    assert [d.assign(f"r{i}", PROMPT, view([0, 1], [0])).prefill_worker for i in range(3)] == [0, 1, 0]
    assert len(d.pending) == 0


def test_conditional_disaggregation_sends_a_short_uncached_tail_to_the_decode_worker() -> None:
    d = dispatcher(conditional_disagg=True, local_prefill_threshold=8)
    holds(d, "decode", 1, PROMPT[:20])
    # decode worker 1 (the least loaded) holds 20 of 26 tokens: it computes the 6 itself
    assert d.assign("a", PROMPT, view([0], [1])) == Assignment(COLOCATED, 1)
    assert d.num_local_prefills == 1
    # the decode worker that holds the prompt is chosen over a less loaded one, within the load skew
    assert d.assign("b", PROMPT, ClusterView([0], [0, 1], {}, {1: 7}, {})) == Assignment(COLOCATED, 1)
    assert d.assign("c", PROMPT, ClusterView([0], [0, 1], {}, {1: 8}, {})).prefill_worker == 0
    # a tail longer than the threshold, or no decode worker up that holds the prompt, goes to a prefill worker
    assert d.assign("d", [*PROMPT, *range(9)], view([0], [1])).prefill_worker == 0
    assert d.assign("e", PROMPT, view([0], [0])).prefill_worker == 0


def test_conditional_disaggregation_is_off_by_default() -> None:
    d = dispatcher()
    holds(d, "decode", 0, PROMPT)
    assert d.assign("a", PROMPT, view([0], [0])).prefill_worker == 0


def test_colocated_cluster_needs_no_prefill_worker() -> None:
    d = Dispatcher(RouterConfig("m", "r", num_prefill=0, num_decode=1), PrefixIndex())
    assert d.assign("a", PROMPT, view([], [0])) == Assignment(COLOCATED, 0)


def test_request_table_counts_requests_per_worker() -> None:
    table = RequestTable()
    a, b = (table.open(rid, np.array([1, 2]), Sampling(), 0.0) for rid in ("a", "b"))
    table.place(a, 0, 1, prefill_tokens=2, reserved_blocks=3)
    table.place(b, 0, 0, prefill_tokens=2, reserved_blocks=5)
    with pytest.raises(DuplicateRequestError):
        table.open("a", np.array([1]), Sampling(), 0.0)
    assert (table.num_at_prefill[0], table.num_at_decode[1], table.reserved_at_decode[1]) == (2, 1, 3)
    table.mark_past_prefill(a)
    assert table.awaiting_prefill(0) == [a, b] and table.at_decode(1) == [a]
    a.decode_started = True
    assert table.awaiting_prefill(0) == [b] and table.prefill_load()[0].queued_tokens == 2
    # a migration: the lost attempt's counts go, the next attempt has its own worker-side id
    table.unplace(b)
    b.attempt += 1
    table.place(b, 1, 1, reserved_blocks=5)
    assert table.by_worker("b") is None and table.by_worker("b#migrated-1") is b
    assert (table.num_at_decode[0], table.reserved_at_decode[1]) == (0, 8)
    table.close("a")
    table.close("b")
    assert len(table) == 0 and not table.by_worker_id
    assert +table.num_at_prefill == {} and +table.num_at_decode == {} and +table.reserved_at_decode == {}
