"""Checkpoint reading: safetensors (single file or sharded index) and seeded dummy weights."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from pdserve.core.models.layers import MergedLinear, VocabEmbedding
from pdserve.core.models.moe import ExpertPiece, FusedExperts
from pdserve.core.parallel import Shard
from pdserve.kernels.swiglu_gemm import deinterleave_gate_up


class CheckpointTensor:
    """A safetensors tensor read on demand: narrow() and t() compose, read() loads only the slice they leave,
    so each TP rank reads its own rows or columns of the file and no more."""

    def __init__(self, view: Any, shape: tuple[int, ...], index: tuple[slice, ...] | None = None) -> None:
        self._view, self._stored = view, shape
        self._index = index or tuple(slice(0, n) for n in shape)
        self._transposed = False

    @property
    def shape(self) -> tuple[int, ...]:
        sizes = tuple(s.stop - s.start for s in self._index)
        return sizes[::-1] if self._transposed else sizes

    def t(self) -> CheckpointTensor:
        """The 2-D transpose (GPT-2's Conv1D weights are stored [in, out])."""
        out = CheckpointTensor(self._view, self._stored, self._index)
        out._transposed = not self._transposed
        return out

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        stored_dim = len(self._index) - 1 - dim if self._transposed else dim
        index = list(self._index)
        first = index[stored_dim].start + start
        index[stored_dim] = slice(first, first + length)
        out = CheckpointTensor(self._view, self._stored, tuple(index))
        out._transposed = self._transposed
        return out

    def read(self) -> torch.Tensor:
        tensor = self._view[self._index]
        return tensor.t() if self._transposed else tensor


Weight = torch.Tensor | CheckpointTensor
"""A checkpoint tensor: in memory (tests, conversions) or still in its file."""


def read(weight: Weight) -> torch.Tensor:
    return weight.read() if isinstance(weight, CheckpointTensor) else weight


def iter_safetensors(folder: str | Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of model.safetensors, or of the shards listed in model.safetensors.index.json, unread
    (valid until the iteration moves on)."""
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
                view = f.get_slice(key)
                yield key, CheckpointTensor(view, tuple(view.get_shape()))


def _part_rows(model: nn.Module) -> dict[str, tuple[str, MergedLinear, slice, Shard]]:
    """Checkpoint module name of each MergedLinear part (e.g. model.layers.0.self_attn.q_proj) -> (the merged
    module's name, the module, the part's rows in it, the rows of the checkpoint's part it holds)."""
    out = {}
    for fused_name, fused in model.named_modules():
        if isinstance(fused, MergedLinear):
            parent = fused_name.rpartition(".")[0]
            for part, shard in fused.sources.items():
                start, rows = fused.shard_rows(part)
                key = f"{parent}.{part}" if parent else part
                out[key] = (fused_name, fused, slice(start, start + rows), shard)
    return out


def _expert_pieces(model: nn.Module) -> dict[str, tuple[str, list[ExpertPiece]]]:
    """Checkpoint name of each expert tensor (e.g. model.layers.0.mlp.experts.3.gate_proj.weight) -> (the
    FusedExperts module's name, where its pieces go) (core/models/moe.py)."""
    out = {}
    for module_name, module in model.named_modules():
        if isinstance(module, FusedExperts):
            for suffix, pieces in module.checkpoint_pieces().items():
                out[f"{module_name}.{suffix}"] = (module_name, pieces)
    return out


def _copy_expert_pieces(
    name: str, tensor: Weight, module: str, pieces: list[ExpertPiece], params: dict[str, nn.Parameter]
) -> dict[str, int]:
    """Copy this rank's slices of an expert tensor into the stacked weights; returns elements copied per parameter."""
    copied: dict[str, int] = {}
    for piece in pieces:
        if tuple(tensor.shape) != piece.full_shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {piece.full_shape}")
        target = f"{module}.{piece.param}"
        dest = params[target][piece.dest]
        with torch.no_grad():
            dest.copy_(read(tensor.narrow(piece.shard.dim, piece.shard.start, piece.shard.length)))
        copied[target] = copied.get(target, 0) + dest.numel()
    return copied


def _narrowed(name: str, tensor: Weight, shard: Shard | None, param: torch.Tensor) -> torch.Tensor:
    """The slice of tensor that param (a parameter, or a part's rows of one) holds, read; ValueError when the
    checkpoint's shape does not fit."""
    want = list(param.shape)
    if shard is not None:
        want[shard.dim] = shard.full
    if list(tensor.shape) != want:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(want)}")
    return read(tensor if shard is None else tensor.narrow(shard.dim, shard.start, shard.length))


def copy_weights(model: nn.Module, weights: Iterable[tuple[str | None, Weight]]) -> set[str]:
    """Copy (name, tensor) pairs into same-named parameters (or their rows of a MergedLinear, or their slices of
    stacked expert weights), each parameter's own shard of the tensor (core/models/layers.py, moe.py); None names
    are skipped. Returns the parameters filled whole
    (a merged one once all its parts came).

    Unknown names and shape mismatches raise: a checkpoint that does not fit is an error, not a warning.
    """
    params = dict(model.named_parameters())
    parts, experts = _part_rows(model), _expert_pieces(model)
    filled: dict[str, int] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        if name is None:
            continue
        module, _, leaf = name.rpartition(".")  # e.g. model.layers.0.self_attn.q_proj / weight
        if name in experts:  # NOTE: a stacked expert weight is whole once every one of its elements came
            for target, count in _copy_expert_pieces(name, tensor, *experts[name], params).items():
                filled[target] = filled.get(target, 0) + count
                if filled[target] == params[target].numel():
                    loaded.add(target)
            continue
        if name in params:
            target, fused, param = name, None, params[name]
            shard = getattr(param, "shard", None)
            dest = param if shard is None or shard.dim else param[: shard.length]  # NOTE: vocab padding rows
        elif module in parts:
            fused_name, fused, rows, shard = parts[module]
            target = f"{fused_name}.{leaf}"
            dest = params[target][rows]
        else:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter")
        with torch.no_grad():
            dest.copy_(_narrowed(name, tensor, shard, dest))
        filled[target] = filled.get(target, 0) + 1
        if fused is None or filled[target] == len(fused.shards):
            loaded.add(target)
    return loaded


_STACKED_EXPERT_NAMES = {"w13": "gate_up_proj", "w2": "down_proj"}


def unmerged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names and shapes (views, but copies of interleaved parts): each
    MergedLinear split back into its parts, each VocabEmbedding without its padding rows, stacked experts under
    transformers' in-memory names (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I])."""
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        fused = modules.get(module)
        if isinstance(fused, VocabEmbedding):
            out[name] = tensor[: fused.vocab_size]
        if isinstance(fused, FusedExperts):
            out[f"{module}.{_STACKED_EXPERT_NAMES[leaf]}"] = tensor
            continue
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


class GlobalIndex(NamedTuple):
    """Where a sharded parameter's elements sit in the unsharded one: row r, column c of the local tensor is
    element rows[r] * full_cols + cols[c] there (rows None: r; cols None: c)."""

    rows: torch.Tensor | None
    cols: torch.Tensor | None
    full_cols: int

    def of(self, flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The unsharded element index of each local flat index (rows: every dimension but the last)."""
        cols = shape[-1] if len(shape) >= 2 else 1
        r, c = flat // cols, flat % cols
        rows = r if self.rows is None else self.rows.to(flat.device)[r]
        return rows * self.full_cols + (c if self.cols is None else self.cols.to(flat.device)[c])


def hash_uniform_(out: torch.Tensor, key: int, low: float, high: float, where: GlobalIndex | None = None) -> None:
    """Fill out with uniforms in [low, high) drawn by splitmix64 of (key, element index): the same values on
    every device, whatever its SM count, and (with where) in every TP shard as in the unsharded tensor.

    NOTE: not torch's CUDA generator: its values depend on the launch grid, hence on the number of SMs, which
    an MPS SM share changes, so two processes drawing "the same" seeded weights would disagree.
    """
    flat = out.view(-1)  # NOTE: parameters are contiguous
    for start in range(0, flat.numel(), DUMMY_CHUNK):
        end = min(flat.numel(), start + DUMMY_CHUNK)
        index = torch.arange(start, end, dtype=torch.int64, device=out.device)
        if where is not None:
            index = where.of(index, out.shape)
        z = index * _GOLDEN + _int64(key)
        z = (z ^ _shr(z, 30)) * _MIX1
        z = (z ^ _shr(z, 27)) * _MIX2
        z = z ^ _shr(z, 31)
        unit = _shr(z, 40).to(torch.float32) * (1.0 / (1 << 24))  # [end - start] in [0, 1)
        flat[start:end] = (low + (high - low) * unit).to(out.dtype)


def global_index(module: nn.Module, param: torch.Tensor) -> GlobalIndex | None:
    """param's place in the unsharded model (None: it is not sharded). A sharded parameter is split along its
    first dimension (rows) or its last (columns, the rows being every other dimension flattened)."""
    cols = param.shape[-1] if param.dim() >= 2 else 1
    if isinstance(module, MergedLinear):
        return GlobalIndex(module.global_rows(), None, cols)
    if isinstance(module, FusedExperts) and param is module.w13:
        return GlobalIndex(module.w13_global_rows(), None, cols)
    shard: Shard | None = getattr(param, "shard", None)
    if shard is None:
        return None
    span = torch.arange(shard.start, shard.start + param.shape[shard.dim])
    return GlobalIndex(span, None, cols) if shard.dim == 0 else GlobalIndex(None, span, shard.full)


def fill_dummy(model: nn.Module, seed: int) -> None:
    """Seeded random weights for benchmarks: norms at 1, everything else small uniform noise, a function of
    (seed, parameter name, element index in the unsharded parameter) only: every TP size holds the same model."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                param.fill_(1.0)
            else:
                key = _splitmix64((seed << 32) | zlib.crc32(name.encode()))
                hash_uniform_(param, key, -1e-2, 1e-2, global_index(modules[name.rpartition(".")[0]], param))
