"""Llama family: RMSNorm, rope (llama3/linear/yarn scaling too), GQA, SwiGLU, optional tied embeddings.

Covers Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head RMSNorm of q and k before rope, head_dim set
explicitly) and SmolLM2. Parameter names follow Hugging Face so checkpoints load 1:1. The MoE families
(core/models/qwen3_moe.py, mixtral.py) reuse these blocks with another feed-forward (core/models/moe.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pdserve.core.config import ModelConfig
from pdserve.core.models.activations import activation
from pdserve.core.models.layers import MergedLinear, RowParallelLinear, VocabEmbedding, column_shard
from pdserve.core.models.loading import copy_weights
from pdserve.core.models.rope import RotaryEmbedding
from pdserve.core.parallel import Shard, even_split, kv_head_range, tp_group
from pdserve.kernels.attention import AttentionBackend, AttentionMetadata, OutputRows, Rope
from pdserve.kernels.fused_ops import rms_norm, silu_and_mul
from pdserve.kernels.swiglu_gemm import (
    FUSED_MIN_TOKENS,
    SWIGLU_BLOCK,
    fused_swiglu_supported,
    interleave_gate_up,
    swiglu_gemm,
)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None: x is the stream itself (the embeddings)
        partial: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), in one fused pass on CUDA; without residual, (norm(x), x). With
        partial, x is this rank's partial sum: summed over the TP group first (fused with the rest where it fits).

        NOTE: same op order as transformers (normalize in fp32, cast, then scale) so fp32 on CPU matches bit for
        bit; see kernels/fused_ops.py.
        """
        if residual is None:
            assert not partial, "the first norm's input (the embeddings) is never a partial sum"
            return rms_norm(x, self.weight, self.eps), x
        if partial:
            return tp_group().all_reduce_rms_norm(x, residual, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps, residual)


QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe"})
"""Model types whose attention RMS-normalizes each head of q and k before rope."""


class HeadNorm(nn.Module):
    """RMSNorm over head_dim, applied to every head of q or k alike (Qwen3's q_norm / k_norm)."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, heads, head_dim] -> [n, heads, head_dim] contiguous
        # NOTE: x is usually a strided view of the qkv GEMM's output; reshape copies it into [n * heads, head_dim]
        # rows, the layout fused_ops.rms_norm (Triton on CUDA) takes. Both tensors are fresh allocations of a
        # fixed size per pass, so the pass stays capturable in CUDA graphs.
        rows = x.reshape(-1, x.shape[-1])  # [n * heads, head_dim]
        return rms_norm(rows, self.weight, self.eps).view(x.shape)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        hf = cfg.hf_config
        # NOTE: Llama's attention_bias covers q/k/v/o; Qwen2 always has q/k/v bias and no o bias (Qwen3 none),
        # Qwen2-MoE has q/k/v bias where qkv_bias (its default).
        o_bias = bool(getattr(hf, "attention_bias", False))
        bias = o_bias or hf.model_type == "qwen2" or bool(getattr(hf, "qkv_bias", False))
        tp, d = tp_group(), cfg.head_dim
        q_start, self.num_heads = even_split(cfg.num_heads, tp.size, tp.rank, "num_attention_heads")
        kv_start, self.num_kv_heads = kv_head_range(cfg.num_kv_heads, tp.size, tp.rank)
        self.head_dim = d
        q = Shard(0, q_start * d, self.num_heads * d, cfg.num_heads * d)
        kv = Shard(0, kv_start * d, self.num_kv_heads * d, cfg.num_kv_heads * d)
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv}, bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, o_bias, reduce=o_bias)
        self.scale = cfg.head_dim**-0.5
        self.backend = backend
        qk_norm = hf.model_type in QK_NORM_TYPES
        self.q_norm = HeadNorm(d, hf.rms_norm_eps) if qk_norm else None
        self.k_norm = HeadNorm(d, hf.rms_norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rope: Rope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rows: OutputRows | None,
    ) -> torch.Tensor:  # [num_tokens, hidden], or [num_rows, hidden] for the rows alone
        # NOTE: the backend applies rope inside its kernels (the KV append and the attention's q loads)
        if rows is None:
            q, k, v = self.qkv_proj(x).split(self.qkv_proj.splits, dim=-1)  # [num_tokens, (heads | kv_heads) * d]
            out = self.backend.forward(*self._heads(q, k, v), kv_cache, meta, self.scale, rope)
        else:  # NOTE: every token's K/V goes to the cache, but only the rows need q (2/3 of the qkv GEMM)
            q_size = self.qkv_proj.splits[0]
            k, v = self.qkv_proj.rows(x, q_size).split(self.qkv_proj.splits[1:], dim=-1)
            q = self.qkv_proj.rows(x[rows.index], 0, q_size)  # [num_rows, heads * d]
            out = self.backend.forward_rows(*self._heads(q, k, v), kv_cache, meta, self.scale, rope)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))

    def _heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, heads * d] -> [n, heads, d] views (rows strided when they are parts of one GEMM's output); with
        q/k norms, q and k normalized per head (new tensors), before the backend rotates them."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        bias = bool(getattr(hf, "mlp_bias", False))
        inter = column_shard(cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate_proj": inter, "up_proj": inter}, bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias, reduce=bias)
        self.act = activation(hf.hidden_act)
        self.fused_silu = hf.hidden_act == "silu"
        self.partial = self.down_proj.partial
        """forward returns this rank's partial sum (the next norm sums it)."""

    def interleave_weights(self) -> bool:
        """Store gate/up in SWIGLU_BLOCK-row blocks for the fused SwiGLU GEMM (kernels/swiglu_gemm.py) where it can
        run (CUDA, sm_90+, 16-bit, SiLU, no bias); returns whether it did. Call once, after the weights are in."""
        proj = self.gate_up_proj
        if proj.interleave or not self.fused_silu or not fused_swiglu_supported(proj.weight, proj.bias):
            return False
        with torch.no_grad():
            proj.weight.copy_(interleave_gate_up(proj.weight))
        proj.interleave = SWIGLU_BLOCK
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden]
        if self.gate_up_proj.interleave:
            if x.shape[0] >= FUSED_MIN_TOKENS and x.is_contiguous():
                return self.down_proj(swiglu_gemm(x, self.gate_up_proj.weight))
            return self.down_proj(self.gate_up_proj(x), swiglu=self.gate_up_proj.interleave)
        gate, up = self.gate_up_proj(x).split(self.gate_up_proj.splits, dim=-1)  # [num_tokens, inter] each
        return self.down_proj(silu_and_mul(gate, up) if self.fused_silu else self.act(gate) * up)


FeedForward = Callable[[ModelConfig, int], nn.Module]
"""(config, layer index) -> that layer's feed-forward: [num_tokens, hidden] -> [num_tokens, hidden], this rank's
partial sum where the module's `partial` is True (the next norm sums it over the TP group), else the full sum."""


def returns_partial(module: object) -> bool:
    """Whether a sublayer's output is this rank's partial sum (its `partial`; absent: False)."""
    return bool(getattr(module, "partial", False))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer: int, feed_forward: FeedForward) -> None:
        super().__init__()
        eps = cfg.hf_config.rms_norm_eps
        self.self_attn = LlamaAttention(cfg, backend)  # NOTE: first, so a TP size the heads refuse is named first
        self.mlp = feed_forward(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the previous layer's MLP output (the embeddings for layer 0)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the stream before x was added; None for layer 0
        rope: Rope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rows: OutputRows | None = None,
        partial: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream before it): each norm folds in the pending residual add (as vLLM) and,
        where the sublayer before it returns partial sums (x too, with partial), their sum over the TP group.
        With rows (the last layer), every token's K/V is cached but the outputs are the rows' alone.

        NOTE: the stream is summed as transformers sums it (x + sublayer(x), and + commutes exactly), so fp32
        on CPU stays bit-identical.
        """
        x, residual = self.input_layernorm(x, residual, partial)
        x = self.self_attn(x, rope, kv_cache, meta, rows)
        if rows is not None:
            residual = residual[rows.index]  # [num_rows, hidden]
        x, residual = self.post_attention_layernorm(x, residual, self.self_attn.o_proj.partial)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, feed_forward: FeedForward) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, i, feed_forward) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.hf_config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len)


class LlamaForCausalLM(nn.Module):
    """Implements core.models.base.CausalLM. Families built from the same blocks subclass it and override
    feed_forward (their MLP or MoE block per layer) and checkpoint_name (their checkpoint's names)."""

    capturable = True
    """The forward reads no device value on the host, so CUDA graphs can capture it."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.model = LlamaModel(cfg, backend, self.feed_forward)
        self.tied = bool(getattr(cfg.hf_config, "tie_word_embeddings", False))
        self.lm_head = self.model.embed_tokens if self.tied else VocabEmbedding(cfg.vocab_size, cfg.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        rope = Rope(positions, self.model.rotary_emb.tables)
        *layers, last = self.model.layers
        partial = False  # NOTE: x is the previous layer's feed-forward output, partial where it says so
        for layer, kv_cache in zip(layers, kv_caches, strict=False):
            x, residual = layer(x, residual, rope, kv_cache, meta, partial=partial)
            partial = returns_partial(layer.mlp)
        x, residual = last(x, residual, rope, kv_caches[-1], meta, meta.rows, partial)
        return self.model.norm(x, residual, returns_partial(last.mlp))[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    @staticmethod
    def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
        """Layer `layer`'s feed-forward: the SwiGLU MLP in every layer."""
        return LlamaMLP(cfg)

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor fills (its own name here); None: skip it."""
        if "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight"):
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights(self, ((self.checkpoint_name(n), t) for n, t in weights))


def build(cfg: ModelConfig, backend: AttentionBackend) -> Any:
    return LlamaForCausalLM(cfg, backend)
