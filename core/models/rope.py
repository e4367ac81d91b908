"""Rotary position embeddings computed exactly as Hugging Face transformers computes them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.kernels.rope_tiles import RopeTables


def _rope_type_and_theta(hf: Any) -> tuple[str, float]:
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return rope_type, float(theta)


def inv_freq_and_scale(hf: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """[head_dim // 2] float32 inverse frequencies and the attention scaling of the config's rope type.

    Scaled types (linear, llama3, yarn, ...) use transformers' own init functions so the numbers match.
    """
    rope_type, theta = _rope_type_and_theta(hf)
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponents), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK rope scaling changes with sequence length and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rope over the whole head, with a cos/sin table per position."""

    cos: torch.Tensor  # [max_positions, head_dim] float32
    sin: torch.Tensor

    def __init__(self, hf: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scale = inv_freq_and_scale(hf, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    @property
    def tables(self) -> RopeTables:
        """The tables the attention backend rotates q and k with (kernels/rope_tiles.py casts them to q's dtype
        first, as transformers does)."""
        return RopeTables(self.cos, self.sin)
