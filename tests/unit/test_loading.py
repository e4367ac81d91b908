"""Checkpoint loading into merged projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.core.config import ModelConfig
from pdserve.core.models import load_model
from pdserve.core.models.loading import unmerged_state_dict
from pdserve.kernels.attention import TorchAttention


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


def test_an_interleaved_gate_up_weight_exports_and_runs_as_the_stacked_one(tiny_llama_dir: Path) -> None:
    """kernels/swiglu_gemm.py's layout: [g_0, u_0, g_1, u_1, ...] blocks; checkpoint export undoes it, and the MLP
    over it (cuBLAS-style GEMM + SiLU-and-mul over the blocks) computes what it did over [gate; up]."""
    from pdserve.core.models.llama import LlamaMLP
    from pdserve.kernels.swiglu_gemm import deinterleave_gate_up, interleave_gate_up

    w = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)  # gate rows 0-3, up rows 4-7
    il = interleave_gate_up(w, block=2)
    assert il[:, 0].tolist() == [0, 3, 12, 15, 6, 9, 18, 21]  # g0 g1 u0 u1 g2 g3 u2 u3
    assert torch.equal(deinterleave_gate_up(il, block=2), w)
    model = load_model(ModelConfig.from_pretrained(tiny_llama_dir, dtype="float32"), TorchAttention(), "cpu")
    before = {k: v.clone() for k, v in unmerged_state_dict(model).items()}  # views otherwise
    mlp = next(m for m in model.modules() if isinstance(m, LlamaMLP))
    x = torch.randn(5, mlp.gate_up_proj.in_features, generator=torch.Generator().manual_seed(0))
    want = mlp(x)
    assert not mlp.interleave_weights(), "the fused path needs CUDA: a CPU model keeps [gate; up]"
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(interleave_gate_up(mlp.gate_up_proj.weight, block=32))
    mlp.gate_up_proj.interleave = 32
    torch.testing.assert_close(mlp(x), want, rtol=1e-6, atol=1e-6)
    after = unmerged_state_dict(model)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
