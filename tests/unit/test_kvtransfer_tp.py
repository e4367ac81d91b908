"""KV transfer between TP groups: the group descriptor of a prefill worker's ranks (merge_descriptors), the head
segments a decode rank plans from the two groups' KV head ranges, and shm pulls between groups of every pair
of sizes, which leave each decode rank's pool bit-exact with its heads of the blocks of one "full" pool."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import msgpack
import pytest
import torch

from pdserve.kvtransfer.base import KVTransferError, Segment, merge_descriptors, plan_segments
from pdserve.kvtransfer.factory import make_sink, make_source
from pdserve.kvtransfer.layout import KVLayout, LayoutMismatchError, kv_head_ranges
from pdserve.kvtransfer.pool import KVPool, allocate_kv_pool

LAYOUT = KVLayout(model="tiny", dtype="float32", block_size=4, num_layers=3, num_kv_heads=4, head_dim=8, num_blocks=32)
"""The model's pool as one rank would hold it: 4 KV heads."""
SINK_BLOCKS = 20
SRC = [31, 3, 17, 8, 0, 22]
DST = [1, 19, 5, 6, 12, 2]
SIZES = [1, 2, 4]


def rank_layout(tp_size: int, tp_rank: int, layout: KVLayout = LAYOUT) -> KVLayout:
    return replace(layout, tp_size=tp_size, tp_rank=tp_rank)


def plan(p: int, d: int, d_rank: int, num_kv_heads: int = 4) -> tuple[Segment, ...]:
    """The segments decode rank d_rank of TP d plans against a prefill group of TP p."""
    layout = replace(LAYOUT, num_kv_heads=num_kv_heads)
    return plan_segments(rank_layout(d, d_rank, layout), kv_head_ranges(rank_layout(p, 0, layout).fingerprint()))


# --- segment planning -----------------------------------------------------------------------------------

S = Segment

EXPECTED_SEGMENTS = {
    (1, 1): [(S(0, 0, 0, 4),)],
    (1, 2): [(S(0, 0, 0, 2),), (S(0, 2, 0, 2),)],
    (1, 4): [(S(0, r, 0, 1),) for r in range(4)],
    (2, 1): [(S(0, 0, 0, 2), S(1, 0, 2, 2))],
    (2, 2): [(S(0, 0, 0, 2),), (S(1, 0, 0, 2),)],
    (2, 4): [(S(0, 0, 0, 1),), (S(0, 1, 0, 1),), (S(1, 0, 0, 1),), (S(1, 1, 0, 1),)],
    (4, 1): [(S(0, 0, 0, 1), S(1, 0, 1, 1), S(2, 0, 2, 1), S(3, 0, 3, 1))],
    (4, 2): [(S(0, 0, 0, 1), S(1, 0, 1, 1)), (S(2, 0, 0, 1), S(3, 0, 1, 1))],
    (4, 4): [(S(r, 0, 0, 1),) for r in range(4)],
}
"""(prefill TP, decode TP) -> each decode rank's segments (remote rank, src head, dst head, heads), 4 KV heads."""


@pytest.mark.parametrize(("p", "d"), list(EXPECTED_SEGMENTS))
def test_segments_of_4_kv_heads_between_tp_sizes(p: int, d: int) -> None:
    assert [plan(p, d, r) for r in range(d)] == EXPECTED_SEGMENTS[(p, d)]


def test_segments_of_2_kv_heads_replicated_on_tp_4() -> None:
    # prefill TP 4 holds heads [0], [0], [1], [1]: equal sizes pull rank r from rank r
    assert [plan(4, 4, r, 2) for r in range(4)] == [(S(r, 0, 0, 1),) for r in range(4)]
    # a head our rank number does not hold comes from the lowest rank holding it
    assert plan(4, 1, 0, 2) == (S(0, 0, 0, 1), S(2, 0, 1, 1))
    assert [plan(4, 2, r, 2) for r in range(2)] == [(S(0, 0, 0, 1),), (S(2, 0, 0, 1),)]
    assert [plan(1, 4, r, 2) for r in range(4)] == [(S(0, r // 2, 0, 1),) for r in range(4)]
    assert [plan(2, 4, r, 2) for r in range(4)] == [(S(r // 2, 0, 0, 1),) for r in range(4)]


@pytest.mark.parametrize("size", SIZES)
def test_equal_tp_sizes_pull_rank_r_from_rank_r_whole(size: int) -> None:
    for r in range(size):
        heads = rank_layout(size, r).heads[1]
        assert plan(size, size, r) == (S(r, 0, 0, heads),)


def test_a_head_no_remote_rank_holds_is_a_layout_mismatch() -> None:
    with pytest.raises(LayoutMismatchError, match="KV head 3 is held by no remote rank"):
        plan_segments(rank_layout(2, 1), [(0, 2), (1, 2)])


# --- group descriptors ----------------------------------------------------------------------------------


def rank_descriptor(tp_size: int, tp_rank: int, **fields: object) -> dict:
    layout = rank_layout(tp_size, tp_rank)
    entry = {"tp_rank": tp_rank, "num_blocks": layout.num_blocks, "shape": list(layout.shape), **fields}
    return {"transport": "shm", "fingerprint": layout.fingerprint(), "ranks": [entry]}


def test_merge_joins_the_ranks_in_rank_order() -> None:
    parts = [rank_descriptor(4, r, shm_name=f"pool{r}") for r in (2, 0, 3, 1)]
    merged = merge_descriptors(parts)
    assert merged == {
        "transport": "shm",
        "fingerprint": rank_layout(4, 0).fingerprint(),
        "ranks": [part["ranks"][0] for part in sorted(parts, key=lambda part: part["ranks"][0]["tp_rank"])],
    }
    assert merge_descriptors([merged]) == merged
    assert merge_descriptors([rank_descriptor(1, 0)]) == rank_descriptor(1, 0)


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([], "no descriptors to merge"),
        ([rank_descriptor(2, 0)], r"descriptor ranks \[0\] are not each rank of TP size 2 once"),
        ([rank_descriptor(2, 0), rank_descriptor(2, 0)], r"descriptor ranks \[0, 0\] are not each rank"),
        ([rank_descriptor(2, 0), rank_descriptor(2, 1), rank_descriptor(2, 1)], r"ranks \[0, 1, 1\]"),
        ([rank_descriptor(2, 0), {**rank_descriptor(2, 1), "transport": "cuda_ipc"}], "differ in transport"),
        ([rank_descriptor(2, 0), rank_descriptor(4, 1)], "differ in fingerprint"),
        ([rank_descriptor(2, 0), {**rank_descriptor(2, 1), "ranks": "rank 1"}], "field 'ranks' is 'rank 1'"),
        ([rank_descriptor(2, 0), {**rank_descriptor(2, 1), "ranks": [None]}], "rank entry None is not a mapping"),
        ([{**rank_descriptor(1, 0), "ranks": [{"tp_rank": "0"}]}], "field 'tp_rank' is '0'"),
    ],
)
def test_merge_refuses_descriptors_that_are_not_one_group(parts: list[dict], message: str) -> None:
    with pytest.raises(KVTransferError, match=message):
        merge_descriptors(parts)


# --- shm pulls between groups ------------------------------------------------------------------------------


def full_pool(dtype: str, seed: int) -> torch.Tensor:
    """Random blocks of every KV head: [num_layers, 2, num_blocks, block_size, 4, head_dim]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(replace(LAYOUT, dtype=dtype).shape, generator=gen).to(torch_dtype(dtype))


def torch_dtype(name: str) -> torch.dtype:
    return replace(LAYOUT, dtype=name).torch_dtype


@pytest.fixture
def prefill_group(request: pytest.FixtureRequest) -> Iterator[tuple[torch.Tensor, list[KVPool]]]:
    """(full pool, the shared pools of a prefill group of TP p holding its heads), p = request.param."""
    p, dtype = request.param
    full = full_pool(dtype, seed=p)
    pools = []
    try:
        for r in range(p):
            pool = allocate_kv_pool(rank_layout(p, r, replace(LAYOUT, dtype=dtype)), "cpu", shared=True)
            first, count = pool.layout.heads
            pool.tensor.copy_(full[:, :, :, :, first : first + count])
            pools.append(pool)
        yield full, pools
    finally:
        for pool in pools:
            pool.close()


def group_descriptor(pools: list[KVPool]) -> dict:
    parts = [make_source("shm", pool).descriptor() for pool in reversed(pools)]
    return msgpack.unpackb(msgpack.packb(merge_descriptors(parts)), raw=False)  # NOTE: as it travels


def decode_rank(d: int, r: int, dtype: str = "float32") -> KVPool:
    return allocate_kv_pool(rank_layout(d, r, replace(LAYOUT, dtype=dtype, num_blocks=SINK_BLOCKS)), "cpu", False)


@pytest.mark.parametrize("prefill_group", [(p, "float32") for p in SIZES], indirect=True, ids=lambda x: f"p{x[0]}")
@pytest.mark.parametrize("d", SIZES)
def test_every_decode_rank_pulls_exactly_its_heads(prefill_group: tuple[torch.Tensor, list[KVPool]], d: int) -> None:
    full, pools = prefill_group
    desc = group_descriptor(pools)
    for r in range(d):
        local = decode_rank(d, r)
        sink = make_sink("shm", local, local.layout)
        sink.open(5, desc, pools[0].layout.fingerprint())
        segments = plan_segments(local.layout, kv_head_ranges(desc["fingerprint"]))
        assert set(sink._remotes[5].ranks) == {s.rank for s in segments}  # only the ranks read are mapped
        assert sink.pull(5, SRC, DST).done()
        first, count = local.layout.heads
        assert torch.equal(local.tensor[:, :, DST], full[:, :, SRC, :, first : first + count])
        assert not local.tensor[:, :, [b for b in range(SINK_BLOCKS) if b not in DST]].any()
        sink.close_all()


@pytest.mark.parametrize("prefill_group", [(2, "bfloat16"), (4, "float16")], indirect=True, ids=["p2", "p4"])
def test_half_precision_pulls_are_bit_exact(prefill_group: tuple[torch.Tensor, list[KVPool]]) -> None:
    full, pools = prefill_group
    dtype = pools[0].layout.dtype
    local = decode_rank(1, 0, dtype)
    sink = make_sink("shm", local, local.layout)
    sink.open(0, group_descriptor(pools))
    assert sink.pull(0, SRC, DST).done()
    assert torch.equal(local.tensor[:, :, DST].view(torch.int16), full[:, :, SRC].view(torch.int16))


def test_a_segment_writes_its_heads_of_the_destination_blocks_only() -> None:
    """A pull through a head slice of the local pool (a strided view) lands in the pool, nothing else changes."""
    remote = full_pool("float32", seed=9)
    local = decode_rank(1, 0)
    sink = make_sink("shm", local, local.layout)
    handle = sink._copy({3: remote}, (S(3, 2, 1, 2),), SRC, DST)
    assert handle.done()
    assert torch.equal(local.tensor[:, :, DST, :, 1:3], remote[:, :, SRC, :, 2:4])
    written = torch.zeros_like(local.tensor, dtype=torch.bool)
    written[:, :, DST, :, 1:3] = True
    assert not local.tensor[~written].any()


@pytest.mark.parametrize("prefill_group", [(2, "float32")], indirect=True, ids=["p2"])
def test_pull_checks_ids_against_each_remote_ranks_blocks(prefill_group: tuple[torch.Tensor, list[KVPool]]) -> None:
    _, pools = prefill_group
    desc = group_descriptor(pools)
    smaller = {**desc["ranks"][1], "num_blocks": 16, "shape": [3, 2, 16, 4, 2, 8]}  # rank 1 of 16 blocks
    local = decode_rank(1, 0)
    sink = make_sink("shm", local, local.layout)
    sink.open(0, {**desc, "ranks": [desc["ranks"][0], smaller]})
    with pytest.raises(KVTransferError, match=r"block ids out of range: source \[16\]"):
        sink.pull(0, [3, 16], [1, 2])
    assert not local.tensor.any()
    assert sink.pull(0, [3, 15], [1, 2]).done()


@pytest.mark.parametrize("prefill_group", [(2, "float32")], indirect=True, ids=["p2"])
def test_open_refuses_groups_that_cannot_supply_our_heads(prefill_group: tuple[torch.Tensor, list[KVPool]]) -> None:
    _, pools = prefill_group
    desc = group_descriptor(pools)
    local = decode_rank(4, 3)
    sink = make_sink("shm", local, local.layout)
    partial = {**desc["fingerprint"], "kv_head_ranges": [[0, 2], [0, 2]]}  # nobody holds heads 2 and 3
    with pytest.raises(LayoutMismatchError, match=r"heads \[2, 3\] are held by no rank"):
        sink.open(0, {**desc, "fingerprint": partial})
    with pytest.raises(LayoutMismatchError, match=r"heads \[2, 3\] are held by no rank"):
        sink.open(0, desc, partial)
    shifted = {**desc["fingerprint"], "kv_head_ranges": [[0, 2], [1, 3]]}  # well formed, not kv_head_range's split
    with pytest.raises(KVTransferError, match=r"remote rank 1 holds KV heads \(1, 3\), TP rank 1 here \(2, 2\)"):
        sink.open(0, {**desc, "fingerprint": shifted})
    assert not sink.is_open(0)


@pytest.mark.parametrize("prefill_group", [(4, "float32")], indirect=True, ids=["p4"])
def test_reopening_maps_again_only_for_a_new_descriptor(prefill_group: tuple[torch.Tensor, list[KVPool]]) -> None:
    full, pools = prefill_group
    desc = group_descriptor(pools)
    local = decode_rank(2, 1)
    sink = make_sink("shm", local, local.layout)
    sink.open(0, desc)
    mapped = sink._remotes[0]
    assert sorted(mapped.ranks) == [2, 3]
    sink.open(0, desc)
    assert sink._remotes[0] is mapped
    restarted = allocate_kv_pool(pools[2].layout, "cpu", shared=True)  # rank 2 restarted: a new (zero) pool
    try:
        renamed = group_descriptor([*pools[:2], restarted, *pools[3:]])
        assert renamed != desc
        sink.open(0, renamed)
        assert sink._remotes[0] is not mapped
        assert sink.pull(0, SRC, DST).done()
        assert not local.tensor[:, :, DST, :, 0].any()
        assert torch.equal(local.tensor[:, :, DST, :, 1], full[:, :, SRC, :, 3])
    finally:
        restarted.close()
