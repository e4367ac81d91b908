"""The KV pool's layout, and the fingerprint two workers compare before one reads the other's pool.

NOTE: a pool is one contiguous tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 of dim 1 is K, 1 is V). Two pools are compatible when everything but num_blocks agrees: block
ids differ between pools, the bytes of one block do not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from pdserve.core.config import EngineConfig, torch_dtype

FINGERPRINT_FIELDS = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
"""The fields of KVLayout that must agree between a source and a sink, in message order."""


class LayoutMismatchError(ValueError):
    """Two KV layouts disagree; the message names every differing field."""


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one worker's KV pool."""

    model: str
    """ModelConfig.name: workers of different models never share KV."""
    dtype: str
    """KV dtype name: float32 | float16 | bfloat16."""
    block_size: int
    """Tokens per block."""
    num_layers: int
    """Transformer layers (dim 0 of the pool)."""
    num_kv_heads: int
    """Key/value heads per layer."""
    head_dim: int
    """Width of one head."""
    num_blocks: int
    """Blocks in this pool (block 0 is the null block); not part of the fingerprint."""

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)  # ValueError on an unknown name
        sizes = {f: getattr(self, f) for f in ("block_size", "num_layers", "num_kv_heads", "head_dim", "num_blocks")}
        bad = [f"{name}={value}" for name, value in sizes.items() if value < 1]
        if bad:
            raise ValueError(f"KV layout sizes must be positive: {', '.join(bad)}")

    @classmethod
    def from_engine_config(cls, cfg: EngineConfig, num_blocks: int) -> KVLayout:
        """The layout of the pool an engine with cfg allocates (num_blocks as resolved at run time)."""
        m = cfg.model
        return cls(
            model=m.name,
            dtype=cfg.cache.kv_dtype or m.dtype,
            block_size=cfg.cache.block_size,
            num_layers=m.num_layers,
            num_kv_heads=cfg.kv_heads_per_rank,
            head_dim=m.head_dim,
            num_blocks=num_blocks,
        )

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.torch_dtype.itemsize

    def fingerprint(self) -> dict[str, Any]:
        """Everything but num_blocks, as plain values (msgpack-able)."""
        values = asdict(self)
        return {name: values[name] for name in FINGERPRINT_FIELDS}


def check_compatible(local_fp: dict[str, Any], remote_fp: dict[str, Any]) -> None:
    """Raise LayoutMismatchError naming every field where the two fingerprints differ.

    Keys beyond FINGERPRINT_FIELDS are compared too, so a newer peer's extra field is not ignored.
    """
    names = list(FINGERPRINT_FIELDS) + sorted((set(local_fp) | set(remote_fp)) - set(FINGERPRINT_FIELDS))
    diffs = [_describe(name, local_fp, remote_fp) for name in names if _differs(name, local_fp, remote_fp)]
    if diffs:
        raise LayoutMismatchError("KV layout mismatch: " + "; ".join(diffs))


def _differs(name: str, local_fp: dict[str, Any], remote_fp: dict[str, Any]) -> bool:
    return (name in local_fp) != (name in remote_fp) or local_fp.get(name) != remote_fp.get(name)


def _describe(name: str, local_fp: dict[str, Any], remote_fp: dict[str, Any]) -> str:
    local = local_fp.get(name, "<missing>")
    remote = remote_fp.get(name, "<missing>")
    return f"{name} {local} != {remote}"
