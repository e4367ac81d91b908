"""LeaseTable: every way a lease ends returns its exact block ids, once."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer.lease import LeaseTable

TTL = 30.0


def table_with_three() -> LeaseTable:
    """Leases 1, 2, 3: decode workers 0, 1, 0; granted at t = 0, 1, 2."""
    table = LeaseTable()
    assert table.grant("a", 0, [5, 6, 7], now=0.0, ttl=TTL) == 1
    assert table.grant("b", 1, [8], now=1.0, ttl=TTL) == 2
    assert table.grant("c", 0, [9, 10], now=2.0, ttl=TTL) == 3
    return table


def test_grant_counts_leases_and_blocks() -> None:
    table = table_with_three()
    assert len(table) == 3
    assert table.num_leased_blocks == 6
    lease = table.get(3)
    assert lease is not None and lease.block_ids == (9, 10) and lease.deadline == 32.0


def test_lease_ids_are_monotonic_never_reused() -> None:
    table = LeaseTable()
    first = table.grant("a", 0, [1], now=0.0, ttl=TTL)
    table.release([first])
    assert table.grant("b", 0, [1], now=0.0, ttl=TTL) == first + 1


def test_release_returns_blocks_in_the_order_given() -> None:
    table = table_with_three()
    assert table.release([3, 1]) == [9, 10, 5, 6, 7]
    assert len(table) == 1 and table.num_leased_blocks == 1


def test_double_and_unknown_release_is_harmless() -> None:
    table = table_with_three()
    assert table.release([2]) == [8]
    assert table.release([2]) == []
    assert table.release([2, 2, 99]) == []
    assert table.release([1, 1]) == [5, 6, 7]
    assert len(table) == 1 and table.num_leased_blocks == 2


def test_expire_boundary_is_inclusive_of_the_deadline() -> None:
    table = table_with_three()
    assert table.expire(29.999) == []
    assert table.expire(30.0) == [5, 6, 7]
    assert table.expire(30.0) == []
    assert table.expire(32.0) == [8, 9, 10]
    assert len(table) == 0 and table.num_leased_blocks == 0


def test_expire_orders_by_deadline_not_grant_order() -> None:
    table = LeaseTable()
    table.grant("long", 0, [1], now=0.0, ttl=100.0)
    table.grant("short", 0, [2], now=0.0, ttl=10.0)
    assert table.expire(100.0) == [2, 1]


def test_released_lease_does_not_expire_later() -> None:
    table = table_with_three()
    table.release([1])
    assert table.expire(1000.0) == [8, 9, 10]


def test_reclaim_returns_every_block_of_that_worker_only() -> None:
    table = table_with_three()
    assert table.reclaim(0) == [5, 6, 7, 9, 10]
    assert table.reclaim(0) == []
    assert table.release([1, 3]) == []
    assert table.expire(1000.0) == [8]


def test_shared_block_is_returned_once_per_lease() -> None:
    table = LeaseTable()
    table.grant("a", 0, [4, 5], now=0.0, ttl=TTL)
    table.grant("b", 0, [4, 6], now=0.0, ttl=TTL)
    assert table.num_leased_blocks == 4
    assert table.reclaim(0) == [4, 5, 4, 6]


def test_grant_copies_the_block_list() -> None:
    table = LeaseTable()
    blocks = [1, 2]
    lease_id = table.grant("a", 0, blocks, now=0.0, ttl=TTL)
    blocks.append(3)
    assert table.release([lease_id]) == [1, 2]


def test_grant_refuses_non_positive_ttl() -> None:
    with pytest.raises(ValueError, match="ttl"):
        LeaseTable().grant("a", 0, [1], now=0.0, ttl=0.0)
