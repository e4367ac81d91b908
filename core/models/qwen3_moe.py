"""Qwen3-MoE (and Qwen2-MoE): Qwen3's attention (per-head q/k norms; Qwen2-MoE: q/k/v bias instead, see
core/models/llama.py) with a sparse MoE feed-forward (core/models/moe.py) in the layers the config makes sparse,
the dense SwiGLU MLP in the others. Qwen2-MoE's blocks add a gated shared expert.

Checkpoint names: `mlp.gate.weight` (router), `mlp.experts.{e}.{gate,up,down}_proj.weight` (as transformers
saves them) or the stacked `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`; Qwen2-MoE's
`mlp.shared_expert.{gate,up,down}_proj.weight` and `mlp.shared_expert_gate.weight`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pdserve.core.config import ModelConfig
from pdserve.core.models.llama import LlamaForCausalLM, LlamaMLP
from pdserve.core.models.moe import MoeArgs, SparseMoeBlock, experts_capturable


def moe_args(hf: Any) -> MoeArgs:
    """Qwen3-MoE's (and Qwen2-MoE's) routing: softmax, top-k, renormalized when norm_topk_prob; weights in the
    activation dtype."""
    num_experts = getattr(hf, "num_experts", None) or hf.num_local_experts
    return MoeArgs(
        num_experts=num_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.moe_intermediate_size,
        renormalize=bool(hf.norm_topk_prob),
        fp32_weights=False,
        hidden_act=hf.hidden_act,
        shared_expert_size=getattr(hf, "shared_expert_intermediate_size", 0) or 0,
    )


def is_sparse(hf: Any, layer: int) -> bool:
    """transformers' rule: not listed in mlp_only_layers, and every decoder_sparse_step-th layer."""
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return layer not in (getattr(hf, "mlp_only_layers", None) or []) and (layer + 1) % step == 0


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Implements core.models.base.CausalLM."""

    def __init__(self, cfg: ModelConfig, backend: Any) -> None:
        super().__init__(cfg, backend)
        self.capturable = experts_capturable(self)

    @staticmethod
    def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
        if is_sparse(cfg.hf_config, layer):
            return SparseMoeBlock(moe_args(cfg.hf_config), cfg.hidden_size)
        return LlamaMLP(cfg)


def build(cfg: ModelConfig, backend: Any) -> Any:
    return Qwen3MoeForCausalLM(cfg, backend)
