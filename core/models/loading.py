"""Checkpoint reading: safetensors (single file or sharded index) and seeded dummy weights."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


def iter_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield key, f.get_tensor(key)


def copy_weights(model: nn.Module, weights: Iterable[tuple[str | None, torch.Tensor]]) -> set[str]:
    """Copy (name, tensor) pairs into same-named parameters; None names are skipped.

    Unknown names and shape mismatches raise: a checkpoint that does not fit is an error, not a warning.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name is None:
            continue
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    return loaded


def fill_dummy(model: nn.Module, seed: int) -> None:
    """Seeded random weights for benchmarks: norms at 1, everything else small uniform noise."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                param.fill_(1.0)
            else:
                param.uniform_(-1e-2, 1e-2, generator=gen)
