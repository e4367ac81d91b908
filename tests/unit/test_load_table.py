"""The load counts front ends share (router/load_table.py): each writes its own row of one file in the run dir,
routing and admission read the sums; a restarted front end's row starts at zero; one front end alone counts
exactly as its RequestTable does."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pdserve.core.messages import Sampling
from pdserve.router.dispatch import COLOCATED
from pdserve.router.load_table import (
    NUM_AT_DECODE,
    NUM_AT_PREFILL,
    RESERVED_AT_DECODE,
    TOKENS_AT_PREFILL,
    SharedLoads,
    remove_tables,
    slots_for,
    table_path,
)
from pdserve.router.requests import RequestTable
from pdserve.router.routing import PrefillLoad

PROMPT = np.arange(8, dtype=np.int64)


def two_frontends(run_dir: Path) -> tuple[SharedLoads, SharedLoads]:
    return SharedLoads.open(run_dir, 2, 0, 2, 3), SharedLoads.open(run_dir, 2, 1, 2, 3)


def test_each_front_end_writes_its_own_row_and_reads_the_sums(tmp_path: Path) -> None:
    a, b = two_frontends(tmp_path)
    a.write(RESERVED_AT_DECODE, 2, 7)
    b.write(RESERVED_AT_DECODE, 2, 5)
    b.write(RESERVED_AT_DECODE, 0, 1)
    a.write(NUM_AT_PREFILL, COLOCATED, 4)  # the last slot
    for view in (a, b):
        assert view.totals(RESERVED_AT_DECODE).tolist() == [1, 0, 12, 0]
        assert view.totals(NUM_AT_PREFILL).tolist() == [0, 0, 0, 4]
    assert a.row[RESERVED_AT_DECODE].tolist() == [0, 0, 7, 0] and b.row[RESERVED_AT_DECODE].tolist() == [1, 0, 5, 0]
    assert table_path(tmp_path, 2, slots_for(2, 3)).stat().st_size == 2 * 4 * 4 * 8


def test_a_restarted_front_end_starts_from_a_zero_row_and_leaves_the_others(tmp_path: Path) -> None:
    a, b = two_frontends(tmp_path)
    a.write(NUM_AT_DECODE, 1, 3)
    b.write(NUM_AT_DECODE, 1, 9)
    b.write(TOKENS_AT_PREFILL, 0, 100)
    b_again = SharedLoads.open(tmp_path, 2, 1, 2, 3)  # front end 1 died and came back
    assert b_again.row.tolist() == np.zeros((4, 4)).tolist()
    assert a.totals(NUM_AT_DECODE).tolist() == [0, 3, 0, 0] and a.totals(TOKENS_AT_PREFILL).tolist() == [0] * 4


def test_remove_tables_leaves_a_new_cluster_no_counts_of_the_old_one(tmp_path: Path) -> None:
    a, _ = two_frontends(tmp_path)
    a.write(NUM_AT_DECODE, 1, 3)
    remove_tables(tmp_path)
    assert not list(tmp_path.iterdir())
    assert SharedLoads.open(tmp_path, 2, 1, 2, 3).totals(NUM_AT_DECODE).tolist() == [0] * 4


def test_request_tables_of_two_front_ends_route_by_the_cluster_wide_counts(tmp_path: Path) -> None:
    one, two = (RequestTable(view) for view in two_frontends(tmp_path))
    a = one.open("a", PROMPT, Sampling(), 0.0)
    b = two.open("b", PROMPT, Sampling(), 0.0)
    c = two.open("c", PROMPT, Sampling(), 0.0)
    one.place(a, 0, 1, prefill_tokens=8, reserved_blocks=3)
    two.place(b, 0, 1, prefill_tokens=6, reserved_blocks=5)
    two.place(c, 1, 2, prefill_tokens=2, reserved_blocks=4)
    for table in (one, two):
        assert table.prefill_load() == {0: PrefillLoad(14, 2), 1: PrefillLoad(2, 1)}
        assert (dict(table.decode_counts()), dict(table.decode_reserved())) == ({0: 0, 1: 2, 2: 1}, {0: 0, 1: 8, 2: 4})
    two.mark_past_prefill(b)
    assert one.prefill_load() == {0: PrefillLoad(8, 1), 1: PrefillLoad(2, 1)}
    two.close("b")
    two.close("c")
    assert dict(one.decode_reserved()) == {0: 0, 1: 3, 2: 0} and one.decode_counts()[1] == 1
    one.close("a")
    assert one.prefill_load() == {} and not any(two.decode_reserved().values())


def test_one_front_end_counts_with_its_own_table_alone() -> None:
    table = RequestTable()
    a = table.open("a", PROMPT, Sampling(), 0.0)
    table.place(a, COLOCATED, 1, reserved_blocks=3)
    assert table.decode_reserved() is table.reserved_at_decode and table.decode_counts() is table.num_at_decode
    assert table.decode_reserved()[1] == 3 and table.prefill_load() == {COLOCATED: PrefillLoad(0, 1)}
