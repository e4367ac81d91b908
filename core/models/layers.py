"""Layers the model families share: merged projections, row-parallel outputs and a vocabulary padded for the
logits GEMM, each sharded over this process's TP group (core/parallel.py; at size 1 they are plain layers).

A sharded parameter carries `shard` (core/parallel.py Shard): the slice of the checkpoint tensor it holds, which
loading reads and dummy weights index by (core/models/loading.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pdserve.core.parallel import Shard, TPGroup, even_split, tp_group
from pdserve.kernels.fused_ops import silu_and_mul_blocks
from pdserve.kernels.gemv import gemv, gemv_fits
from pdserve.kernels.triton_utils import use_pdl

VOCAB_PAD = 64
"""Each rank's vocabulary rows are padded to a multiple of this (as vLLM does)."""


def column_shard(full: int, what: str) -> Shard:
    """This rank's equal share of full output rows."""
    tp = tp_group()
    start, length = even_split(full, tp.size, tp.rank, what)
    return Shard(0, start, length, full)


class MergedLinear(nn.Linear):
    """One GEMM for several projections of the same input (q/k/v, gate/up): their output rows stacked in order,
    each part's rows this rank's shard of that part (column-parallel: no communication).

    Checkpoints keep the parts apart; copy_weights fills each part's rows (`shards` names them, in order).
    """

    def __init__(self, in_features: int, parts: dict[str, Shard], bias: bool) -> None:
        super().__init__(in_features, sum(p.length for p in parts.values()), bias=bias)
        self.sources = parts
        """Part name -> the rows of the checkpoint's part tensor this rank holds."""
        self.shards = {name: p.length for name, p in parts.items()}  # part name -> output rows, in stacking order
        self.splits = list(self.shards.values())
        self.interleave = 0
        """Two parts stored in blocks of this many rows, [a_0, b_0, a_1, b_1, ...] (kernels/swiglu_gemm.py's
        layout; LlamaMLP.interleave_weights); 0: stacked in order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        if gemv_fits(x, self.weight):  # NOTE: one row (a decode step at batch 1)
            return gemv(x, self.weight, bias=self.bias, pdl=use_pdl(x))
        return F.linear(x, self.weight, self.bias)

    def rows(self, x: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
        """The projection onto output rows [start, stop) of the stacked weight alone (one part's GEMM)."""
        bias = None if self.bias is None else self.bias[start:stop]
        return F.linear(x, self.weight[start:stop], bias)

    def shard_rows(self, part: str) -> tuple[int, int]:
        """(first row, rows) of a part in the stacked weight."""
        names = list(self.shards)
        return sum(self.splits[: names.index(part)]), self.shards[part]

    def global_rows(self) -> torch.Tensor:
        """[out_features] int64: each local row's row in the unsharded stacked weight."""
        offsets, rows = 0, []
        for part in self.sources.values():
            rows.append(torch.arange(part.start, part.start + part.length) + offsets)
            offsets += part.full
        return torch.cat(rows)


class ColumnParallelLinear(nn.Linear):
    """nn.Linear holding this rank's share of the output rows (and of the bias)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, what: str) -> None:
        shard = column_shard(out_features, what)
        super().__init__(in_features, shard.length, bias=bias)
        self.weight.shard = shard  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.shard = shard  # type: ignore[attr-defined]


class RowParallelLinear(nn.Linear):
    """nn.Linear holding this rank's share of the input columns: partial sums, one all-reduce, then the bias.

    With reduce=False (no bias) the output stays this rank's partial sum (`partial`): the RMSNorm after it sums
    it over the ranks, fused with the residual add and the norm (core/parallel.py TPGroup.all_reduce_rms_norm).
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, shard: Shard | None = None, reduce: bool = True
    ) -> None:
        tp = tp_group()
        if shard is None:
            start, length = even_split(in_features, tp.size, tp.rank, "the row-parallel input")
            shard = Shard(1, start, length, in_features)
        if bias and not reduce:
            raise ValueError("a row-parallel output with a bias must be reduced before the bias is added")
        super().__init__(shard.length, out_features, bias=bias)
        self.weight.shard = shard  # type: ignore[attr-defined]
        self.tp: TPGroup = tp
        self.partial = tp.size > 1 and not reduce
        """forward returns this rank's partial sum (the caller sums it over the ranks)."""

    def forward(self, x: torch.Tensor, swiglu: int = 0) -> torch.Tensor:
        """The projection of x, or with swiglu, of silu(gate) * up of x, an interleaved gate/up output in blocks of
        `swiglu` columns (kernels/swiglu_gemm.py's layout). One row goes through kernels/gemv.py, which applies the
        SwiGLU itself and, where this output is a partial sum the fused sum after it takes, writes it into the
        peers' buffers as it computes it (TPGroup.push_target)."""
        if self.bias is None and gemv_fits(x, self.weight, swiglu):
            push = self.tp.push_target(1, self.out_features, x.dtype) if self.partial else None
            local = gemv(x, self.weight, swiglu, push=push, pdl=use_pdl(x))
            if push is not None:
                self.tp.note_pushed(local)
            return local if self.tp.size == 1 or self.partial else self.tp.all_reduce(local)
        if swiglu:
            x = silu_and_mul_blocks(x, swiglu)
        if self.tp.size == 1 or self.partial:
            return F.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabEmbedding(nn.Module):
    """Token embeddings split by vocabulary rows over the ranks, each share padded to a multiple of VOCAB_PAD
    rows; also the (tied) lm_head, whose logits the ranks all-gather.

    NOTE: an odd vocabulary (GPT-2's 50257) makes the logits' row stride misaligned, and cuBLAS then falls
    back to a kernel several times slower (docs/benchmarks.md, decode throughput). The padding rows
    are never looked up (token ids are < vocab_size) and their logits are cut off.
    """

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.tp = tp_group()
        self.vocab_size = vocab_size
        rows = -(-vocab_size // (VOCAB_PAD * self.tp.size)) * VOCAB_PAD
        self.start = self.tp.rank * rows
        """The first token id of this rank's rows."""
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.weight.shard = Shard(0, self.start, max(0, min(rows, vocab_size - self.start)), vocab_size)  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine.unsqueeze(1)
        return self.tp.all_reduce(rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab_size] float32
        return self.tp.all_gather(hidden @ self.weight.t())[:, : self.vocab_size].float()
