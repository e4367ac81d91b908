"""GPT-2: learned positions, pre-LayerNorm blocks, fused qkv, GELU MLP, tied embeddings.

Checkpoints store Conv1D weights as [in, out]; they are transposed into nn.Linear on load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pdserve.core.config import ModelConfig
from pdserve.core.models.activations import activation
from pdserve.core.models.layers import ColumnParallelLinear, MergedLinear, RowParallelLinear, VocabEmbedding
from pdserve.core.models.loading import Weight, copy_weights
from pdserve.core.parallel import Shard, even_split, tp_group
from pdserve.kernels.attention import AttentionBackend, AttentionMetadata, OutputRows
from pdserve.kernels.layer_norm import layer_norm

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        tp, d = tp_group(), cfg.head_dim
        start, self.num_heads = even_split(cfg.num_heads, tp.size, tp.rank, "n_head")
        self.head_dim = d
        heads = Shard(0, start * d, self.num_heads * d, cfg.num_heads * d)
        self.c_attn = MergedLinear(cfg.hidden_size, {f"c_attn_{p}": heads for p in "qkv"}, bias=True)
        self.c_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.scale = cfg.head_dim**-0.5
        self.backend = backend

    def forward(
        self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, rows: OutputRows | None
    ) -> torch.Tensor:  # [num_tokens, hidden], or [num_rows, hidden] for the rows alone
        # views of the fused projection, [tokens, heads, dim] each (the backend takes any token/head strides)
        q, k, v = self.c_attn(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        if rows is None:
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        else:
            out = self.backend.forward_rows(q[rows.index], k, v, kv_cache, meta, self.scale)
        return self.c_proj(out.reshape(-1, self.num_heads * self.head_dim))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, "n_inner")
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = activation(cfg.hf_config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class ResidualLayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters) that folds in the pending residual add: see kernels/layer_norm.py."""

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None: x is the stream itself (the embeddings)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without residual, (norm(x), x)."""
        if residual is None:
            return layer_norm(x, self.weight, self.bias, self.eps), x
        return layer_norm(x, self.weight, self.bias, self.eps, residual)


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        eps = cfg.hf_config.layer_norm_epsilon
        self.ln_1 = ResidualLayerNorm(cfg.hidden_size, eps=eps)
        self.attn = GPT2Attention(cfg, backend)
        self.ln_2 = ResidualLayerNorm(cfg.hidden_size, eps=eps)
        self.mlp = GPT2MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the previous block's MLP output (the embeddings for block 0)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the stream before x was added; None for block 0
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rows: OutputRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream before it): each norm folds in the pending residual add, as in Llama.
        With rows (the last block), every token's K/V is cached but the outputs are the rows' alone."""
        x, residual = self.ln_1(x, residual)
        x = self.attn(x, kv_cache, meta, rows)
        if rows is not None:
            residual = residual[rows.index]  # [num_rows, hidden]
        x, residual = self.ln_2(x, residual)
        return self.mlp(x), residual


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.wte = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_model_len, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, backend) for _ in range(cfg.num_layers))
        self.ln_f = ResidualLayerNorm(cfg.hidden_size, eps=cfg.hf_config.layer_norm_epsilon)


class GPT2LMHeadModel(nn.Module):
    """Implements core.models.base.CausalLM."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.transformer = GPT2Model(cfg, backend)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.transformer.wte(input_ids) + self.transformer.wpe(positions)  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        *blocks, last = self.transformer.h
        for block, kv_cache in zip(blocks, kv_caches, strict=False):
            x, residual = block(x, residual, kv_cache, meta)
        x, residual = last(x, residual, kv_caches[-1], meta, meta.rows)
        return self.transformer.ln_f(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte.logits(hidden)  # tied lm_head

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> set[str]:
        hidden = self.transformer.wpe.weight.shape[1]

        def renamed() -> Iterator[tuple[str, Weight]]:
            for name, tensor in weights:
                if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
                    continue
                name = name if name.startswith("transformer.") else f"transformer.{name}"
                tensor = tensor.t() if name.endswith(_CONV1D) else tensor
                module, _, leaf = name.rpartition(".")
                if module.endswith(".attn.c_attn"):  # NOTE: q, k and v stacked: each is a part of its own
                    for i, part in enumerate("qkv"):
                        yield f"{module}_{part}.{leaf}", tensor.narrow(0, i * hidden, hidden)
                else:
                    yield name, tensor

        return copy_weights(self, renamed())


def build(cfg: ModelConfig, backend: AttentionBackend) -> Any:
    return GPT2LMHeadModel(cfg, backend)
