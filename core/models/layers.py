"""Layers the model families share: merged projections and a vocabulary padded for the logits GEMM."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB_PAD = 64
"""Vocabulary rows are padded to a multiple of this (as vLLM does)."""


class MergedLinear(nn.Linear):
    """One GEMM for several projections of the same input (q/k/v, gate/up): their output rows stacked in order.

    Checkpoints keep the parts apart; copy_weights fills each part's rows (`shards` names them, in order).
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = shards  # part name -> output rows, in stacking order
        self.splits = list(shards.values())
        self.interleave = 0
        """Two parts stored in blocks of this many rows, [a_0, b_0, a_1, b_1, ...] (kernels/swiglu_gemm.py's
        layout; LlamaMLP.interleave_weights); 0: stacked in order."""

    def rows(self, x: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
        """The projection onto output rows [start, stop) of the stacked weight alone (one part's GEMM)."""
        bias = None if self.bias is None else self.bias[start:stop]
        return F.linear(x, self.weight[start:stop], bias)

    def shard_rows(self, part: str) -> tuple[int, int]:
        """(first row, rows) of a part in the stacked weight."""
        names = list(self.shards)
        return sum(self.splits[: names.index(part)]), self.shards[part]


class VocabEmbedding(nn.Module):
    """Token embeddings whose table is padded to a multiple of VOCAB_PAD rows; also the (tied) lm_head.

    NOTE: an odd vocabulary (GPT-2's 50257) makes the logits' row stride misaligned, and cuBLAS then falls
    back to a slow kernel (128 us instead of ~20 us for a 128-row decode step on an H200). The padding rows
    are never looked up (token ids are < vocab_size) and their logits are cut off.
    """

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(-(-vocab_size // VOCAB_PAD) * VOCAB_PAD, hidden))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        return F.embedding(input_ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab_size] float32
        return (hidden @ self.weight.t())[:, : self.vocab_size].float()
