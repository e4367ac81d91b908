"""core/hf_config.py reads config.json without transformers for the families it lists: its defaults are
transformers' own, and every field core/models reads equals what AutoConfig gives for the test models; a sliding
window caps the model's context."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import (
    AutoConfig,
    GPT2Config,
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from pdserve.core.config import ModelConfig
from pdserve.core.hf_config import DEFAULTS, read_plain
from pdserve.core.models import mixtral, qwen3_moe, rope

USED = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "attention_bias",
    "mlp_bias", "tie_word_embeddings", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
    "activation_function", "layer_norm_epsilon", "eos_token_id", "moe_intermediate_size", "num_local_experts",
    "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "qkv_bias", "num_experts",
    "shared_expert_intermediate_size", "use_sliding_window", "sliding_window",
)  # fmt: skip
MOE_ARGS = {"qwen3_moe": qwen3_moe.moe_args, "mixtral": mixtral.moe_args}


@pytest.mark.parametrize(
    ("family", "cls"),
    [
        ("llama", LlamaConfig),
        ("gpt2", GPT2Config),
        ("qwen3", Qwen3Config),
        ("qwen3_moe", Qwen3MoeConfig),
        ("mixtral", MixtralConfig),
        ("qwen2", Qwen2Config),
        ("qwen2_moe", Qwen2MoeConfig),
    ],
)
def test_defaults_are_the_transformers_defaults(family: str, cls: type) -> None:
    hf = cls()
    for key, value in DEFAULTS[family].items():
        if key == "head_dim" and value is None:  # NOTE: transformers derives it; so do we (hidden // heads)
            continue
        if key == "num_key_value_heads" and value is None:
            assert hf.num_key_value_heads == hf.num_attention_heads
            continue
        if key == "rope_theta":  # NOTE: transformers 5 keeps it in rope_parameters
            assert hf.rope_parameters["rope_theta"] == value
            continue
        assert getattr(hf, key) == value, key


@pytest.mark.parametrize(
    "model",
    [
        "tiny_llama_dir",
        "tiny_gpt2_dir",
        "smollm2_dir",
        "tiny_qwen3_dir",
        "tiny_qwen3_moe_dir",
        "tiny_mixtral_dir",
        "tiny_qwen2_moe_dir",
    ],
)
def test_plain_config_equals_autoconfig_where_the_models_read_it(model: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(model)
    plain, hf = read_plain(folder), AutoConfig.from_pretrained(folder)
    assert plain is not None
    for key in USED:  # NOTE: GPT2Config also answers Llama names (hidden_size...) by alias; core/models do not ask
        if hasattr(plain, key) and key != "head_dim":
            assert getattr(plain, key) == getattr(hf, key), key
    a, b = ModelConfig.from_pretrained(folder), ModelConfig.from_hf_config(hf, str(folder))
    assert a == b  # every shape field, eos ids included
    assert rope.inv_freq_and_scale(plain, a.head_dim)[0].equal(rope.inv_freq_and_scale(hf, a.head_dim)[0])
    if a.arch in MOE_ARGS:
        assert MOE_ARGS[a.arch](plain) == MOE_ARGS[a.arch](hf)


def test_qwen3_moe_expert_count_under_either_name(tmp_path: Path, tiny_qwen3_moe_dir: Path) -> None:
    """Qwen's own config.json says num_experts, transformers 5 saves num_local_experts: both read alike."""
    raw = json.loads((tiny_qwen3_moe_dir / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts") * 2
    (tmp_path / "config.json").write_text(json.dumps(raw))
    plain = read_plain(tmp_path)
    assert plain is not None
    assert (
        qwen3_moe.moe_args(plain).num_experts
        == 8
        == qwen3_moe.moe_args(AutoConfig.from_pretrained(tmp_path)).num_experts
    )


def test_other_types_and_scaled_rope_go_through_transformers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    assert read_plain(tmp_path) is None
    scaled = {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}}
    (tmp_path / "config.json").write_text(json.dumps(scaled))
    assert read_plain(tmp_path) is None
    (tmp_path / "config.json").write_text("not json")
    assert read_plain(tmp_path) is None


@pytest.mark.parametrize(
    ("fields", "max_model_len"),
    [
        ({"model_type": "mistral", "sliding_window": 4096}, 4096),
        ({"model_type": "mistral", "sliding_window": None}, 32768),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8192}, 8192),
        ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 8192}, 32768),
        ({"model_type": "qwen2_moe", "use_sliding_window": True, "sliding_window": 0}, 32768),
    ],
)
def test_a_sliding_window_caps_the_context_to_it(fields: dict[str, object], max_model_len: int) -> None:
    """The engine attends to the whole context, which equals windowed attention up to the window's length."""
    hf = SimpleNamespace(
        vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=32768, eos_token_id=0, **fields,
    )  # fmt: skip
    assert ModelConfig.from_hf_config(hf, "/nonexistent").max_model_len == max_model_len
