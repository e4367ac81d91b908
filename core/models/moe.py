"""The sparse MoE feed-forward the MoE families share (core/models/qwen3_moe.py: Qwen3-MoE and Qwen2-MoE;
mixtral.py): a replicated router, softmax / top-k, experts stored as one stacked weight per projection,
tensor-parallel over the expert width, and an optional gated shared expert (Qwen2-MoE).

Layout (this rank of a TP group of size tp, I = the expert width):
    w13: [num_experts, 2 * I / tp, hidden]  rows [0, I/tp) this rank's slice of each expert's gate_proj, then the
                                           same slice of its up_proj (one GEMM gives both, as LlamaMLP's gate_up)
    w2:  [num_experts, hidden, I / tp]      the same slice of each expert's down_proj's input columns
Each rank computes every routed token's partial sum over its slice; one all-reduce at the end, where the dense MLP
has its down_proj's. Expert parallelism would keep these tensors and split dim 0 instead (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from pdserve.core.models.activations import activation
from pdserve.core.models.layers import MergedLinear, column_shard
from pdserve.core.parallel import Shard, TPGroup, tp_group
from pdserve.kernels.fused_moe import fused_moe, fused_moe_ref, triton_available
from pdserve.kernels.fused_ops import silu_and_mul


@dataclass(frozen=True)
class MoeArgs:
    """One MoE feed-forward's shape and routing, as a family's config defines them."""

    num_experts: int
    """Experts per MoE layer."""
    top_k: int
    """Experts each token is routed to."""
    intermediate_size: int
    """Each expert's SwiGLU width (unsharded)."""
    renormalize: bool
    """Divide the top-k probabilities by their sum (Mixtral always; Qwen3-MoE when norm_topk_prob)."""
    fp32_weights: bool
    """Routing weights stay float32 in the weighted sum (Mixtral); else cast to the activation dtype (Qwen3-MoE),
    as transformers does each."""
    hidden_act: str = "silu"
    """The experts' activation (act(gate) * up)."""
    shared_expert_size: int = 0
    """Width of the shared expert every token also goes through, gated by sigmoid(shared_expert_gate(x))
    (Qwen2-MoE); 0: none."""


class Routing(NamedTuple):
    """Each token's experts and their weights."""

    weights: torch.Tensor  # [num_tokens, top_k]: float32 or the activation dtype (MoeArgs.fp32_weights)
    experts: torch.Tensor  # [num_tokens, top_k] int64 expert ids


def route(logits: torch.Tensor, args: MoeArgs) -> Routing:  # logits: [num_tokens, num_experts]
    """softmax in float32, top-k, optionally renormalized: transformers' op order, so fp32 matches bit for bit."""
    probs = torch.softmax(logits.float(), dim=-1)  # [num_tokens, num_experts] float32
    weights, experts = torch.topk(probs, args.top_k, dim=-1)
    if args.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights if args.fp32_weights else weights.to(logits.dtype), experts)


class ExpertPiece(NamedTuple):
    """Where (part of) a checkpoint tensor goes in the stacked weights (core/models/loading.py copies it)."""

    param: str
    """'w13' | 'w2'."""
    dest: tuple[int | slice, ...]
    """The destination's index into that parameter."""
    full_shape: tuple[int, ...]
    """The checkpoint tensor's shape (checked before reading)."""
    shard: Shard
    """The part of the checkpoint tensor this rank reads (one dimension narrowed)."""


class FusedExperts(nn.Module):
    """Every expert's weights, stacked (the module docstring's layout), and their forward."""

    def __init__(self, args: MoeArgs, hidden: int) -> None:
        super().__init__()
        self.args, self.hidden = args, hidden
        self.inter = column_shard(args.intermediate_size, "moe_intermediate_size")
        """This rank's slice of each expert's width (rows of gate/up, columns of down)."""
        num, local = args.num_experts, self.inter.length
        self.w13 = nn.Parameter(torch.empty(num, 2 * local, hidden))
        self.w2 = nn.Parameter(torch.empty(num, hidden, local))
        self.w2.shard = Shard(2, self.inter.start, local, args.intermediate_size)  # type: ignore[attr-defined]
        self.act = activation(args.hidden_act)
        self.fused_silu = args.hidden_act == "silu"

    @property
    def capturable(self) -> bool:
        """Whether the CUDA forward runs the Triton kernels (they fuse SiLU only), which read nothing on the host."""
        return self.fused_silu and triton_available()

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        routing: Routing,
    ) -> torch.Tensor:  # [num_tokens, hidden]: this rank's partial sum (the block all-reduces it)
        """The Triton kernels on CUDA (kernels/fused_moe.py); elsewhere, or for an activation other than SiLU,
        the torch reference loop (eager only: it reads per-expert token counts on the host)."""
        if x.is_cuda and self.capturable:
            return fused_moe(x, self.w13, self.w2, routing.weights, routing.experts)
        return fused_moe_ref(x, self.w13, self.w2, routing.weights, routing.experts, self._act_and_mul)

    def _act_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [m, inter / tp] each
        return silu_and_mul(gate, up) if self.fused_silu else self.act(gate) * up

    def w13_global_rows(self) -> torch.Tensor:
        """[num_experts * 2 * I / tp] int64: each local row of w13 (flattened over experts) as a row of the
        unsharded [num_experts * 2 * I] (seeded dummy weights index by it)."""
        full, shard = self.args.intermediate_size, self.inter
        part = torch.arange(shard.start, shard.start + shard.length)
        per_expert = torch.cat([part, part + full])  # [2 * I / tp]: gate rows, then up rows
        base = torch.arange(self.args.num_experts)[:, None] * (2 * full)
        return (base + per_expert[None, :]).flatten()

    def checkpoint_pieces(self) -> dict[str, list[ExpertPiece]]:
        """Checkpoint names relative to this module -> where they go: per expert (`{e}.gate_proj.weight`,
        `{e}.up_proj.weight`, `{e}.down_proj.weight`, as transformers saves them) or stacked (`gate_up_proj`
        [E, 2I, H] and `down_proj` [E, H, I], transformers' in-memory layout). Each rank reads its slices only."""
        num, full, hidden, shard = self.args.num_experts, self.args.intermediate_size, self.hidden, self.inter
        gate, up = slice(0, shard.length), slice(shard.length, 2 * shard.length)
        rows, cols = shard._replace(dim=0), shard._replace(dim=1)
        out: dict[str, list[ExpertPiece]] = {}
        for e in range(num):
            out[f"{e}.gate_proj.weight"] = [ExpertPiece("w13", (e, gate), (full, hidden), rows)]
            out[f"{e}.up_proj.weight"] = [ExpertPiece("w13", (e, up), (full, hidden), rows)]
            out[f"{e}.down_proj.weight"] = [ExpertPiece("w2", (e,), (hidden, full), cols)]
        stacked = (num, 2 * full, hidden)
        out["gate_up_proj"] = [
            ExpertPiece("w13", (slice(None), gate), stacked, Shard(1, shard.start, shard.length, 2 * full)),
            ExpertPiece("w13", (slice(None), up), stacked, Shard(1, full + shard.start, shard.length, 2 * full)),
        ]
        out["down_proj"] = [ExpertPiece("w2", (slice(None),), (num, hidden, full), shard._replace(dim=2))]
        return out


def experts_capturable(model: nn.Module) -> bool:
    """Whether every MoE layer of a model reads nothing on the host on CUDA (FusedExperts.capturable)."""
    return all(m.capturable for m in model.modules() if isinstance(m, FusedExperts))


class SharedExpert(nn.Module):
    """A SwiGLU MLP every token goes through (Qwen2-MoE's shared_expert), sliced over the ranks as the dense MLP
    is but without its own all-reduce: its partial sum joins the routed experts' before the block's one."""

    def __init__(self, hidden: int, width: int, hidden_act: str) -> None:
        super().__init__()
        inter = column_shard(width, "shared_expert_intermediate_size")
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": inter, "up_proj": inter}, bias=False)
        self.down_proj = nn.Linear(inter.length, hidden, bias=False)
        self.down_proj.weight.shard = Shard(1, inter.start, inter.length, width)  # type: ignore[attr-defined]
        self.act = activation(hidden_act)
        self.fused_silu = hidden_act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden], partial
        gate, up = self.gate_up_proj(x).split(self.gate_up_proj.splits, dim=-1)  # [num_tokens, width / tp] each
        return self.down_proj(silu_and_mul(gate, up) if self.fused_silu else self.act(gate) * up)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated) + experts: sum over each token's top-k experts of weight * expert(x), plus
    sigmoid(shared_expert_gate(x)) * shared_expert(x) where the config has a shared expert."""

    def __init__(self, args: MoeArgs, hidden: int) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(hidden, args.num_experts, bias=False)
        self.experts = FusedExperts(args, hidden)
        self.shared_expert = (
            SharedExpert(hidden, args.shared_expert_size, args.hidden_act) if args.shared_expert_size else None
        )
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if args.shared_expert_size else None
        self.tp: TPGroup = tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden]
        routing = route(self.gate(x), self.args)  # NOTE: every rank routes alike (replicated router and input)
        out = self.experts(x, routing)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # NOTE: the gate is replicated, so scaling each rank's partial sum scales their total
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)
