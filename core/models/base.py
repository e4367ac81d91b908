"""What every model in core/models offers the model runner."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from pdserve.kernels.attention import AttentionMetadata


class CausalLM(Protocol):
    """A decoder-only model over a flat batch of new tokens and a paged KV cache."""

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden], or [len(meta.rows.index), hidden] when meta.rows is set
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into parameters; return the parameter names set."""
        ...
