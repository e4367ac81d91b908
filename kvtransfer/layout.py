"""The KV pool's layout, and the fingerprint two workers compare before one reads the other's pool.

A pool is one contiguous tensor of core.config.kv_pool_shape, [num_layers, 2, num_blocks, block_size, heads,
head_dim] (index 0 of dim 1 is K, 1 is V), where heads are the KV heads of one TP rank: kv_head_range(num_kv_heads,
tp_size, tp_rank) of the model's num_kv_heads. Two groups of ranks are compatible when FINGERPRINT_FIELDS agree and
each group holds every KV head on some rank: block ids differ between pools, and a decode rank pulls each of
its heads from whichever prefill rank holds it (kvtransfer.base plans the head segments).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, TypeGuard

import torch

from pdserve.core.config import EngineConfig, KVPoolShape, kv_pool_shape, torch_dtype
from pdserve.core.parallel import kv_head_range

FINGERPRINT_FIELDS = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
"""The fields of KVLayout that must agree between a source and a sink, in message order."""
GROUP_FIELDS = ("tp_size", "kv_head_ranges")
"""The fingerprint's description of the TP group: its size and [first KV head, KV heads] of every rank. They
may differ between the two sides; a fingerprint without them is a group of one rank holding every head."""


class LayoutMismatchError(ValueError):
    """Two KV layouts disagree; the message names every differing field, or the KV heads no rank holds."""


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one TP rank's KV pool."""

    model: str
    """ModelConfig.name: workers of different models never share KV."""
    dtype: str
    """KV dtype name: float32 | float16 | bfloat16."""
    block_size: int
    """Tokens per block."""
    num_layers: int
    """Transformer layers (dim 0 of the pool)."""
    num_kv_heads: int
    """Key/value heads per layer of the model (all ranks together); the pool holds `heads` of them."""
    head_dim: int
    """Width of one head."""
    num_blocks: int
    """Blocks in this pool (block 0 is the null block); not part of the fingerprint."""
    tp_size: int = 1
    """Ranks of the worker's TP group."""
    tp_rank: int = 0
    """This pool's rank in [0, tp_size); not part of the fingerprint (which describes the whole group)."""

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)  # ValueError on an unknown name
        sizes = {f: getattr(self, f) for f in ("block_size", "num_layers", "num_kv_heads", "head_dim", "num_blocks")}
        bad = [f"{name}={value}" for name, value in sizes.items() if value < 1]
        if bad:
            raise ValueError(f"KV layout sizes must be positive: {', '.join(bad)}")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"TP rank {self.tp_rank} of size {self.tp_size}: need 0 <= rank < size")
        kv_head_range(self.num_kv_heads, self.tp_size, self.tp_rank)  # ValueError on a size that cannot split

    @classmethod
    def from_engine_config(cls, cfg: EngineConfig, num_blocks: int) -> KVLayout:
        """The layout of the pool an engine with cfg allocates (num_blocks as resolved at run time)."""
        m = cfg.model
        return cls(
            model=m.name,
            dtype=cfg.cache.kv_dtype or m.dtype,
            block_size=cfg.cache.block_size,
            num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            num_blocks=num_blocks,
            tp_size=cfg.parallel.tp_size,
            tp_rank=cfg.parallel.tp_rank,
        )

    @property
    def heads(self) -> tuple[int, int]:
        """(first KV head, KV heads) of the model that this rank's pool holds."""
        return kv_head_range(self.num_kv_heads, self.tp_size, self.tp_rank)

    @property
    def shape(self) -> KVPoolShape:
        """[num_layers, 2, num_blocks, block_size, heads of this rank, head_dim] (core.config.kv_pool_shape)."""
        return kv_pool_shape(self.num_layers, self.num_blocks, self.block_size, self.heads[1], self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def fingerprint(self) -> dict[str, Any]:
        """FINGERPRINT_FIELDS and GROUP_FIELDS as plain values (msgpack-able): the same for every rank."""
        values = asdict(self)
        ranges = [list(kv_head_range(self.num_kv_heads, self.tp_size, r)) for r in range(self.tp_size)]
        return {
            **{name: values[name] for name in FINGERPRINT_FIELDS},
            "tp_size": self.tp_size,
            "kv_head_ranges": ranges,
        }


def check_compatible(local_fp: dict[str, Any], remote_fp: dict[str, Any]) -> None:
    """Raise LayoutMismatchError naming every field where the two fingerprints differ, or what one side's group
    cannot supply.

    Keys beyond FINGERPRINT_FIELDS and GROUP_FIELDS are compared too, so a newer peer's extra field is not
    ignored. The group fields need not agree: each side's kv_head_ranges must be well formed and hold every
    KV head on some rank.
    """
    extra = (set(local_fp) | set(remote_fp)) - set(FINGERPRINT_FIELDS) - set(GROUP_FIELDS)
    names = list(FINGERPRINT_FIELDS) + sorted(extra)
    diffs = [_describe(name, local_fp, remote_fp) for name in names if _differs(name, local_fp, remote_fp)]
    if diffs:
        raise LayoutMismatchError("KV layout mismatch: " + "; ".join(diffs))
    for side, fp in (("local", local_fp), ("remote", remote_fp)):
        ranges = kv_head_ranges(fp, side)
        held = {h for first, count in ranges for h in range(first, first + count)}
        missing = [h for h in range(fp["num_kv_heads"]) if h not in held]
        if missing:
            raise LayoutMismatchError(
                f"{side} TP {len(ranges)} holds KV heads {_ranges_text(ranges)} (one list per rank) of "
                f"{fp['num_kv_heads']}; heads {missing} are held by no rank"
            )


def kv_head_ranges(fp: dict[str, Any], side: str = "remote") -> list[tuple[int, int]]:
    """(first KV head, KV heads) of every rank of the group fp describes, rank order; LayoutMismatchError
    naming `side` when the group fields are malformed (tp_size entries, each a range inside the heads)."""
    num_kv_heads, tp_size = fp.get("num_kv_heads"), fp.get("tp_size", 1)
    if not _is_int(num_kv_heads) or num_kv_heads < 1:
        raise LayoutMismatchError(f"{side} num_kv_heads is {num_kv_heads!r}")
    if not _is_int(tp_size) or tp_size < 1:
        raise LayoutMismatchError(f"{side} tp_size is {tp_size!r}")
    ranges = fp.get("kv_head_ranges", [[0, num_kv_heads]] if "tp_size" not in fp else None)
    if not isinstance(ranges, list) or len(ranges) != tp_size or not all(_is_range(r, num_kv_heads) for r in ranges):
        raise LayoutMismatchError(
            f"{side} kv_head_ranges {ranges!r} is not {tp_size} [first, count] ranges of KV heads 0..{num_kv_heads - 1}"
        )
    return [(first, count) for first, count in ranges]


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_range(value: Any, num_kv_heads: int) -> bool:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(_is_int(v) for v in value):
        return False
    first, count = value
    return first >= 0 and count >= 1 and first + count <= num_kv_heads


def _ranges_text(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(str(list(range(first, first + count))) for first, count in ranges)


def _differs(name: str, local_fp: dict[str, Any], remote_fp: dict[str, Any]) -> bool:
    return (name in local_fp) != (name in remote_fp) or local_fp.get(name) != remote_fp.get(name)


def _describe(name: str, local_fp: dict[str, Any], remote_fp: dict[str, Any]) -> str:
    local = local_fp.get(name, "<missing>")
    remote = remote_fp.get(name, "<missing>")
    return f"{name} {local} != {remote}"
