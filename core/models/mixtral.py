"""Mixtral: Mistral's attention (core/models/llama.py) with a sparse MoE feed-forward (core/models/moe.py) in
every layer.

Checkpoint names: `block_sparse_moe.gate.weight` (router) and `block_sparse_moe.experts.{e}.w1/w3/w2.weight`
(gate, up, down; as transformers saves them), read into the shared block's names (`mlp.gate`, `mlp.experts`).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from pdserve.core.config import ModelConfig
from pdserve.core.models.llama import LlamaForCausalLM
from pdserve.core.models.moe import MoeArgs, SparseMoeBlock, experts_capturable

_EXPERT_PROJ = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_PROJ_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def moe_args(hf: Any) -> MoeArgs:
    """Mixtral's routing: softmax, top-k, always renormalized; the weights stay float32 in the weighted sum."""
    return MoeArgs(
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.intermediate_size,
        renormalize=True,
        fp32_weights=True,
        hidden_act=hf.hidden_act,
    )


class MixtralForCausalLM(LlamaForCausalLM):
    """Implements core.models.base.CausalLM."""

    def __init__(self, cfg: ModelConfig, backend: Any) -> None:
        super().__init__(cfg, backend)
        self.capturable = experts_capturable(self)

    @staticmethod
    def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
        return SparseMoeBlock(moe_args(cfg.hf_config), cfg.hidden_size)

    def checkpoint_name(self, name: str) -> str | None:
        renamed = super().checkpoint_name(name.replace(".block_sparse_moe.", ".mlp."))
        if renamed is None:
            return None
        return _EXPERT_PROJ.sub(lambda m: f".experts.{m[1]}.{_PROJ_NAMES[m[2]]}.", renamed)


def build(cfg: ModelConfig, backend: Any) -> Any:
    return MixtralForCausalLM(cfg, backend)
