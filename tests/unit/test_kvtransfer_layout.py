"""KVLayout: the fingerprint ignores num_blocks, and a mismatch names every differing field."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.kvtransfer.layout import KVLayout, LayoutMismatchError, check_compatible

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
                  "head_dim": 16}  # fmt: skip
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
