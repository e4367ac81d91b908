"""Model variants the Llama path covers (llama3 rope scaling, Qwen2-style q/k/v bias, linear rope), sharded
checkpoints, and the seeded dummy load format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.engine import Engine
from pdserve.core.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, random_prompts
from tests.models import make_tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "llama3-rope": {"rope_scaling": LLAMA3_ROPE},
    "linear-rope": {"rope_scaling": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    "qkv-bias": {"attention_bias": True},
    "mha-tied": {"num_key_value_heads": 4, "tie_word_embeddings": True},
}


def engine(model_dir: Path, **model_kw: object) -> Engine:
    model = ModelConfig.from_pretrained(model_dir, **model_kw)  # type: ignore[arg-type]
    return Engine(EngineConfig(model, CacheConfig(num_blocks=128)))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_hf(tmp_path: Path, variant: str) -> None:
    model_dir = make_tiny_llama(tmp_path / variant, seed=3, **VARIANTS[variant])  # type: ignore[arg-type]
    prompts = random_prompts(1024, (3, 40, 90), seed=4)  # 90 + 24 > 64: past llama3's original context
    assert engine(model_dir).generate(prompts, GREEDY) == hf_greedy(model_dir, prompts, 24)


def test_sharded_checkpoint_loads(tmp_path: Path, tiny_llama_dir: Path) -> None:
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    prompts = random_prompts(1024, (7, 20), seed=5)
    assert engine(sharded).generate(prompts, GREEDY) == engine(tiny_llama_dir).generate(prompts, GREEDY)


def test_dummy_weights_are_seeded_and_need_no_checkpoint(tmp_path: Path, tiny_llama_dir: Path) -> None:
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    a = engine(config_only, load_format="dummy", seed=1)
    b = engine(config_only, load_format="dummy", seed=1)
    c = engine(config_only, load_format="dummy", seed=2)
    wa, wb, wc = (e.runner.model.state_dict()["model.layers.0.mlp.gate_up_proj.weight"] for e in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    norm = a.runner.model.state_dict()["model.norm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    assert len(a.generate([[1, 2, 3]], GREEDY)[0]) == GREEDY.max_tokens


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path, tiny_llama_dir: Path) -> None:
    config_only = tmp_path / "no-weights"
    config_only.mkdir()
    (config_only / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        engine(config_only)


def test_unsupported_family_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_llama_family_checkpoints_match_hf(tmp_path: Path, family: str) -> None:
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from tests.models import reinit_decisive

    cls, config_cls = {"qwen2": (Qwen2ForCausalLM, Qwen2Config), "mistral": (MistralForCausalLM, MistralConfig)}[family]
    config = config_cls(
        vocab_size=1024,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = cls(config)
    reinit_decisive(model, torch.Generator().manual_seed(7))
    model.save_pretrained(tmp_path)
    prompts = random_prompts(1024, (5, 33), seed=8)
    assert engine(tmp_path).generate(prompts, GREEDY) == hf_greedy(tmp_path, prompts, 24)


def test_dummy_draws_depend_only_on_key_and_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash fill gives the same values whatever the pass size (so whatever the device's launch grid),
    differs by key, and is uniform over [low, high)."""
    from pdserve.core.models import loading

    whole = torch.empty(3001, 7)
    loading.hash_uniform_(whole, key=42, low=-1e-2, high=1e-2)
    monkeypatch.setattr(loading, "DUMMY_CHUNK", 1000)
    chunked = torch.empty(3001, 7)
    loading.hash_uniform_(chunked, key=42, low=-1e-2, high=1e-2)
    other = torch.empty(3001, 7)
    loading.hash_uniform_(other, key=43, low=-1e-2, high=1e-2)
    assert torch.equal(whole, chunked) and not torch.equal(whole, other)
    assert whole.min() >= -1e-2 and whole.max() < 1e-2
    assert abs(whole.mean().item()) < 2e-4 and abs(whole.std().item() - 0.02 / 12**0.5) < 1e-4
    half = torch.empty(3001, 7, dtype=torch.bfloat16)
    loading.hash_uniform_(half, key=42, low=-1e-2, high=1e-2)
    assert torch.equal(half, whole.bfloat16())


@pytest.mark.gpu
def test_dummy_weights_are_the_same_on_cuda_and_cpu(tiny_llama_dir: Path) -> None:
    """Seeded dummy weights are a function of (seed, name, index): a worker on a GPU (whatever its SM share
    under MPS) holds bit for bit what a CPU process draws."""
    from pdserve.core.models import load_model
    from pdserve.kernels.attention import TorchAttention

    cfg = ModelConfig.from_pretrained(tiny_llama_dir, load_format="dummy", seed=3)
    on_cpu = load_model(cfg, TorchAttention(), "cpu").state_dict()
    on_gpu = load_model(cfg, TorchAttention(), "cuda").state_dict()
    assert on_cpu.keys() == on_gpu.keys()
    assert all(torch.equal(on_cpu[k], on_gpu[k].cpu()) for k in on_cpu)
