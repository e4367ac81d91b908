"""KVLayout: the fingerprint ignores num_blocks and the rank, a mismatch names every differing field; TP groups
of any sizes are compatible when each holds every KV head, and a group that cannot be mapped is named."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.model_runner import kv_bytes_per_block
from pdserve.core.parallel import ParallelConfig
from pdserve.kvtransfer.layout import KVLayout, LayoutMismatchError, check_compatible, kv_head_ranges

LAYOUT = KVLayout(
    model="tiny", dtype="float32", block_size=16, num_layers=4, num_kv_heads=2, head_dim=16, num_blocks=64
)


def model_config(**overrides: object) -> ModelConfig:
    fields: dict = dict(
        path="/models/tiny",
        name="tiny",
        arch="llama",
        vocab_size=1024,
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_model_len=512,
        eos_token_ids=(1023,),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def test_from_engine_config_reads_model_and_cache() -> None:
    cfg = EngineConfig(model_config(), CacheConfig(block_size=16))
    assert KVLayout.from_engine_config(cfg, num_blocks=64) == LAYOUT
    assert LAYOUT.shape == (4, 2, 64, 16, 2, 16)
    assert LAYOUT.nbytes == 4 * 2 * 64 * 16 * 2 * 16 * 4


def test_kv_dtype_overrides_model_dtype() -> None:
    cfg = EngineConfig(model_config(dtype="float32"), CacheConfig(kv_dtype="bfloat16"))
    assert KVLayout.from_engine_config(cfg, num_blocks=8).dtype == "bfloat16"


def test_fingerprint_is_everything_but_num_blocks_and_msgpackable() -> None:
    fp = LAYOUT.fingerprint()
    assert fp == {"model": "tiny", "dtype": "float32", "block_size": 16, "num_layers": 4, "num_kv_heads": 2,
                  "head_dim": 16, "tp_size": 1, "kv_head_ranges": [[0, 2]]}  # fmt: skip
    assert replace(LAYOUT, num_blocks=1000).fingerprint() == fp
    assert msgpack.unpackb(msgpack.packb(fp), raw=False) == fp


def test_equal_fingerprints_are_compatible() -> None:
    check_compatible(LAYOUT.fingerprint(), replace(LAYOUT, num_blocks=3).fingerprint())


def test_mismatch_message_names_each_differing_field_local_first() -> None:
    remote = replace(LAYOUT, block_size=32, dtype="bfloat16").fingerprint()
    with pytest.raises(LayoutMismatchError) as info:
        check_compatible(LAYOUT.fingerprint(), remote)
    assert str(info.value) == "KV layout mismatch: dtype float32 != bfloat16; block_size 16 != 32"


def test_mismatch_names_model_layers_heads_and_head_dim() -> None:
    remote = replace(LAYOUT, model="other", num_layers=5, num_kv_heads=4, head_dim=8).fingerprint()
    with pytest.raises(LayoutMismatchError) as info:
        check_compatible(LAYOUT.fingerprint(), remote)
    message = str(info.value)
    for part in ("model tiny != other", "num_layers 4 != 5", "num_kv_heads 2 != 4", "head_dim 16 != 8"):
        assert part in message
    assert "block_size" not in message and "dtype" not in message


def test_missing_and_extra_fields_are_mismatches() -> None:
    remote = LAYOUT.fingerprint()
    del remote["head_dim"]
    remote["kv_scale"] = 2
    with pytest.raises(LayoutMismatchError, match=r"head_dim 16 != <missing>; kv_scale <missing> != 2"):
        check_compatible(LAYOUT.fingerprint(), remote)


def test_layout_refuses_unknown_dtype_and_empty_sizes() -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        replace(LAYOUT, dtype="int8")
    with pytest.raises(ValueError, match="num_blocks=0"):
        replace(LAYOUT, num_blocks=0)


# --- TP groups --------------------------------------------------------------------------------------------

LAYOUT4 = replace(LAYOUT, num_kv_heads=4)


def rank_layout(tp_size: int, tp_rank: int, layout: KVLayout = LAYOUT4) -> KVLayout:
    return replace(layout, tp_size=tp_size, tp_rank=tp_rank)


def test_from_engine_config_takes_the_models_heads_and_the_rank() -> None:
    cfg = EngineConfig(model_config(), CacheConfig(block_size=16), parallel=ParallelConfig(tp_size=2, tp_rank=1))
    layout = KVLayout.from_engine_config(cfg, num_blocks=64)
    assert layout == replace(LAYOUT, tp_size=2, tp_rank=1)
    assert layout.heads == (1, 1) and layout.shape == (4, 2, 64, 16, 1, 16)
    assert layout.nbytes == LAYOUT.nbytes // 2


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_layout_pool_is_the_runners_pool(tp_size: int) -> None:
    cfg = EngineConfig(
        model_config(), CacheConfig(block_size=16, kv_dtype="bfloat16"), parallel=ParallelConfig(tp_size=tp_size)
    )
    layout = KVLayout.from_engine_config(cfg, num_blocks=64)
    assert layout.nbytes == 64 * kv_bytes_per_block(cfg)
    assert layout.shape[4] == cfg.kv_heads_per_rank


def test_rank_layouts_hold_their_share_or_a_replicated_head() -> None:
    assert [rank_layout(4, r).heads for r in range(4)] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert [rank_layout(2, r).heads for r in range(2)] == [(0, 2), (2, 2)]
    assert [rank_layout(4, r, LAYOUT).heads for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert rank_layout(2, 1).shape == (4, 2, 64, 16, 2, 16)


def test_layout_refuses_bad_ranks_and_sizes_that_cannot_split_the_heads() -> None:
    with pytest.raises(ValueError, match="TP rank 2 of size 2"):
        rank_layout(2, 2)
    with pytest.raises(ValueError, match="TP rank 0 of size 0"):
        rank_layout(0, 0)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(4\) is not divisible by the TP size 3"):
        rank_layout(3, 0)
    with pytest.raises(ValueError, match="TP size 6 is neither a divisor nor a multiple"):
        rank_layout(6, 0)


def test_fingerprint_describes_the_whole_group_and_is_the_same_on_every_rank() -> None:
    fps = [rank_layout(4, r).fingerprint() for r in range(4)]
    assert all(fp == fps[0] for fp in fps)
    assert fps[0]["tp_size"] == 4 and fps[0]["kv_head_ranges"] == [[0, 1], [1, 1], [2, 1], [3, 1]]
    assert rank_layout(4, 3, LAYOUT).fingerprint()["kv_head_ranges"] == [[0, 1], [0, 1], [1, 1], [1, 1]]
    assert msgpack.unpackb(msgpack.packb(fps[0]), raw=False) == fps[0]


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_groups_of_any_tp_sizes_are_compatible(p: int, d: int) -> None:
    check_compatible(rank_layout(d, d - 1).fingerprint(), rank_layout(p, 0).fingerprint())
    check_compatible(rank_layout(p, 0, LAYOUT).fingerprint(), rank_layout(d, 0, LAYOUT).fingerprint())


def test_a_fingerprint_without_group_fields_is_one_rank_holding_every_head() -> None:
    old = {name: value for name, value in LAYOUT4.fingerprint().items() if name not in ("tp_size", "kv_head_ranges")}
    assert kv_head_ranges(old) == [(0, 4)]
    check_compatible(rank_layout(2, 1).fingerprint(), old)
    check_compatible(old, rank_layout(4, 0).fingerprint())


def test_a_group_that_leaves_heads_unheld_is_refused_naming_them() -> None:
    remote = {**LAYOUT4.fingerprint(), "tp_size": 3, "kv_head_ranges": [[0, 1], [1, 1], [1, 1]]}
    with pytest.raises(LayoutMismatchError) as info:
        check_compatible(rank_layout(2, 0).fingerprint(), remote)
    held = "[0], [1], [1] (one list per rank)"
    assert str(info.value) == f"remote TP 3 holds KV heads {held} of 4; heads [2, 3] are held by no rank"
    with pytest.raises(LayoutMismatchError, match=r"^local TP 3 holds .* heads \[2, 3\] are held by no rank$"):
        check_compatible(remote, rank_layout(2, 0).fingerprint())


@pytest.mark.parametrize(
    "group",
    [
        {"tp_size": 2, "kv_head_ranges": [[0, 4]]},  # one range for two ranks
        {"tp_size": 2},  # a size without ranges
        {"tp_size": 1, "kv_head_ranges": [[2, 4]]},  # past the last head
        {"tp_size": 1, "kv_head_ranges": [[0, 0]]},  # no head
        {"tp_size": 1, "kv_head_ranges": [[-1, 2]]},
        {"tp_size": 1, "kv_head_ranges": [[0, True]]},
        {"tp_size": 1, "kv_head_ranges": [0, 4]},
        {"tp_size": 1, "kv_head_ranges": "all"},
        {"tp_size": 0, "kv_head_ranges": []},
        {"tp_size": "2", "kv_head_ranges": [[0, 2], [2, 2]]},
    ],
)
def test_malformed_group_fields_are_refused(group: dict) -> None:
    remote = {**LAYOUT4.fingerprint(), **group}
    with pytest.raises(LayoutMismatchError, match="^remote (kv_head_ranges|tp_size) "):
        check_compatible(LAYOUT4.fingerprint(), remote)


def test_field_mismatches_are_named_before_group_fields_are_read() -> None:
    remote = {**LAYOUT4.fingerprint(), "num_kv_heads": 8, "tp_size": "x"}
    with pytest.raises(LayoutMismatchError, match=r"^KV layout mismatch: num_kv_heads 4 != 8$"):
        check_compatible(LAYOUT4.fingerprint(), remote)
