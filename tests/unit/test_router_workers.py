"""router.workers.Liveness and router.dispatch: who is up, and which worker gets the next request."""

from __future__ import annotations

import pytest

from core.messages import HeartbeatEvent
from router.dispatch import Assignment, NoWorkerError, assign, choose_decode, choose_prefill
from router.requests import DuplicateRequestError, RequestTable
from router.workers import Change, Liveness


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


def test_prefill_choice_is_least_loaded_then_lowest_id() -> None:
    assert choose_prefill([0, 1, 2], {0: 2, 1: 1, 2: 1}) == 1
    assert choose_prefill([2, 0], {}) == 0
    assert choose_prefill([], {}) is None


def test_decode_choice_is_fewest_running_then_most_free_blocks_then_lowest_id() -> None:
    assert choose_decode([0, 1], {0: 3, 1: 1}, {0: 100, 1: 5}) == 1
    assert choose_decode([0, 1, 2], {}, {0: 5, 1: 50, 2: 50}) == 1
    assert choose_decode([1], {0: 0}, {}) == 1


def test_assignment_needs_a_worker_of_each_role_up() -> None:
    assert assign([0], [1], {}, {}, {}) == Assignment(0, 1)
    with pytest.raises(NoWorkerError, match="prefill"):
        assign([], [0], {}, {}, {})
    with pytest.raises(NoWorkerError, match="decode"):
        assign([0], [], {}, {}, {})


def test_request_table_counts_requests_per_worker() -> None:
    table = RequestTable()
    a, b = table.open("a", 0, 1), table.open("b", 0, 0)
    with pytest.raises(DuplicateRequestError):
        table.open("a", 1, 1)
    assert (table.num_at_prefill[0], table.num_at_decode[1]) == (2, 1)
    table.mark_past_prefill(a)
    assert table.at_prefill(0) == [b] and table.at_decode(1) == [a]
    table.close("a")
    table.close("b")
    assert len(table) == 0 and +table.num_at_prefill == {} and +table.num_at_decode == {}
