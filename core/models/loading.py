"""Checkpoint reading: safetensors (single file or sharded index) and seeded dummy weights."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.core.models.layers import MergedLinear, VocabEmbedding
from pdserve.kernels.swiglu_gemm import deinterleave_gate_up


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


def _part_rows(model: nn.Module) -> dict[str, tuple[str, MergedLinear, slice]]:
    """Checkpoint module name of each MergedLinear part (e.g. model.layers.0.self_attn.q_proj) -> (the merged
    module's name, the module, the part's rows)."""
    out = {}
    for fused_name, fused in model.named_modules():
        if isinstance(fused, MergedLinear):
            parent = fused_name.rpartition(".")[0]
            for part in fused.shards:
                start, rows = fused.shard_rows(part)
                out[f"{parent}.{part}" if parent else part] = (fused_name, fused, slice(start, start + rows))
    return out


def copy_weights(model: nn.Module, weights: Iterable[tuple[str | None, torch.Tensor]]) -> set[str]:
    """Copy (name, tensor) pairs into same-named parameters (or their rows of a MergedLinear); None names are
    skipped. Returns the parameters filled whole (a merged one once all its parts came).

    Unknown names and shape mismatches raise: a checkpoint that does not fit is an error, not a warning.
    """
    params = dict(model.named_parameters())
    parts = _part_rows(model)
    vocabs = {n: m for n, m in model.named_modules() if isinstance(m, VocabEmbedding)}
    filled: dict[str, int] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        if name is None:
            continue
        module, _, leaf = name.rpartition(".")  # e.g. model.layers.0.self_attn.q_proj / weight
        if name in params:
            target, fused, vocab = name, None, vocabs.get(module)
            rows = None if vocab is None else slice(0, vocab.vocab_size)
        elif module in parts:
            fused_name, fused, rows = parts[module]
            target = f"{fused_name}.{leaf}"
        else:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter")
        param = params[target] if rows is None else params[target][rows]
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        filled[target] = filled.get(target, 0) + 1
        if fused is None or filled[target] == len(fused.shards):
            loaded.add(target)
    return loaded


def unmerged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names and shapes (views, but copies of interleaved parts): each
    MergedLinear split back into its parts, each VocabEmbedding without its padding rows."""
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        fused = modules.get(module)
        if isinstance(fused, VocabEmbedding):
            out[name] = tensor[: fused.vocab_size]
        if not isinstance(fused, MergedLinear):
            out.setdefault(name, tensor)
            continue
        parent = module.rpartition(".")[0]
        stacked = deinterleave_gate_up(tensor, fused.interleave) if fused.interleave else tensor
        for part, piece in zip(fused.shards, stacked.split(fused.splits), strict=True):
            out[f"{parent}.{part}.{leaf}"] = piece
    return out


DUMMY_CHUNK = 1 << 24
"""Elements hashed per pass (bounds the int64 scratch: 128 MiB)."""
_M64 = (1 << 64) - 1


def _int64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch holds (same bits)."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


_GOLDEN, _MIX1, _MIX2 = (_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _splitmix64(x: int) -> int:
    """splitmix64's finalizer on a Python int (a parameter's stream key)."""
    z = (x * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch shifts arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def hash_uniform_(out: torch.Tensor, key: int, low: float, high: float) -> None:
    """Fill out with uniforms in [low, high) drawn by splitmix64 of (key, element index): the same values on
    every device, whatever its SM count.

    NOTE: not torch's CUDA generator: its values depend on the launch grid, hence on the number of SMs, which
    an MPS SM share changes, so two processes drawing "the same" seeded weights would disagree.
    """
    flat = out.view(-1)  # NOTE: parameters are contiguous
    for start in range(0, flat.numel(), DUMMY_CHUNK):
        end = min(flat.numel(), start + DUMMY_CHUNK)
        z = torch.arange(start, end, dtype=torch.int64, device=out.device) * _GOLDEN + _int64(key)
        z = (z ^ _shr(z, 30)) * _MIX1
        z = (z ^ _shr(z, 27)) * _MIX2
        z = z ^ _shr(z, 31)
        unit = _shr(z, 40).to(torch.float32) * (1.0 / (1 << 24))  # [end - start] in [0, 1)
        flat[start:end] = (low + (high - low) * unit).to(out.dtype)


def fill_dummy(model: nn.Module, seed: int) -> None:
    """Seeded random weights for benchmarks: norms at 1, everything else small uniform noise, a function of
    (seed, parameter name, element index) only."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                param.fill_(1.0)
            else:
                key = _splitmix64((seed << 32) | zlib.crc32(name.encode()))
                hash_uniform_(param, key, -1e-2, 1e-2)
