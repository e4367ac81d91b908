"""Checkpoint loading into merged projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.config import ModelConfig
from core.models import load_model
from core.models.loading import unmerged_state_dict
from kernels.attention import TorchAttention


def test_merged_projections_hold_the_checkpoint_parts_in_order(tiny_llama_dir: Path) -> None:
    model = load_model(ModelConfig.from_pretrained(tiny_llama_dir, dtype="float32"), TorchAttention(), "cpu")
    checkpoint = load_file(str(tiny_llama_dir / "model.safetensors"))
    qkv = model.get_parameter("model.layers.1.self_attn.qkv_proj.weight")
    q, k, v = (checkpoint[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj"))
    assert torch.equal(qkv, torch.cat([q, k, v]))
    embed = model.get_parameter("model.embed_tokens.weight")
    assert embed.shape[0] % 64 == 0 and torch.equal(
        embed[: len(checkpoint["model.embed_tokens.weight"])], checkpoint["model.embed_tokens.weight"]
    )
    exported = unmerged_state_dict(model)
    for name, tensor in checkpoint.items():
        if name != "lm_head.weight" or name in exported:
            assert torch.equal(exported[name], tensor), name
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in exported)


def test_a_checkpoint_missing_one_part_of_a_merged_projection_is_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    checkpoint = load_file(str(tiny_llama_dir / "model.safetensors"))
    del checkpoint["model.layers.0.mlp.up_proj.weight"]
    save_file(checkpoint, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="gate_up_proj"):
        load_model(ModelConfig.from_pretrained(folder, dtype="float32"), TorchAttention(), "cpu")


def test_a_part_of_the_wrong_shape_is_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    folder = tmp_path / "wrong"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    checkpoint = load_file(str(tiny_llama_dir / "model.safetensors"))
    k = checkpoint["model.layers.0.self_attn.k_proj.weight"]
    checkpoint["model.layers.0.self_attn.k_proj.weight"] = torch.cat([k, k])
    save_file(checkpoint, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj"):
        load_model(ModelConfig.from_pretrained(folder, dtype="float32"), TorchAttention(), "cpu")
