"""Model families and the loader that builds one from a ModelConfig."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from pdserve.core.config import ModelConfig
from pdserve.core.models import gpt2, llama, mixtral, qwen3_moe
from pdserve.core.models.loading import fill_dummy, iter_safetensors
from pdserve.kernels.attention import AttentionBackend

_BUILDERS = {"llama": llama.build, "gpt2": gpt2.build, "qwen3_moe": qwen3_moe.build, "mixtral": mixtral.build}


def load_model(cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str) -> nn.Module:
    """Build the model on `device` in cfg.dtype and fill its weights (checkpoint or seeded dummy).

    NOTE: parameters are made in cfg.dtype, never in float32 first (the peak would be twice a bf16 model's bytes);
    the rope tables are computed in float32 explicitly and cast by the .to() after.
    """
    with torch.device(device), _default_dtype(cfg.torch_dtype):
        model: nn.Module = _BUILDERS[cfg.arch](cfg, backend)
    model.to(dtype=cfg.torch_dtype)
    model.eval().requires_grad_(False)
    if cfg.load_format == "dummy":
        fill_dummy(model, cfg.seed)
        return model
    loaded = model.load_weights(iter_safetensors(cfg.path))  # type: ignore[operator]
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint {cfg.path} lacks parameters: {sorted(missing)[:5]}")
    return model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def interleave_mlp_weights(model: nn.Module) -> int:
    """Every MLP that can run the fused SwiGLU GEMM stores its gate/up weight for it; returns how many did."""
    return sum(m.interleave_weights() for m in model.modules() if isinstance(m, llama.LlamaMLP))
