"""The shared MoE block (core/models/moe.py): routing and the expert loop against a straightforward per-token
reference (an expert that gets no token included), its TP slices of checkpoints and dummy weights, and the MoE
families at TP 2 (gloo) against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from pdserve.core import parallel
from pdserve.core.config import ModelConfig, SchedulerConfig
from pdserve.core.models.moe import FusedExperts, MoeArgs, SparseMoeBlock, route
from pdserve.core.parallel import TPGroup
from tests.hf_reference import hf_greedy, random_prompts
from tests.unit.test_tensor_parallel import build, tp_greedy

HIDDEN, TOKENS = 16, 23
TP_NEW_TOKENS = 32


def block(args: MoeArgs, rank: int = 0, size: int = 1) -> SparseMoeBlock:
    before = parallel._GROUP
    parallel._GROUP = TPGroup(rank, size)
    try:
        return SparseMoeBlock(args, HIDDEN)
    finally:
        parallel._GROUP = before


def seeded(moe: SparseMoeBlock, seed: int) -> SparseMoeBlock:
    """Random experts; a router whose last expert scores far below the others (feature 0 is always 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        moe.gate.weight[:, 0] = torch.tensor([2.0, 2.0, 2.0, -50.0])
    return moe


def inputs(seed: int) -> torch.Tensor:  # [TOKENS, HIDDEN]
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))
    x[:, 0] = 1.0
    return x


def reference(moe: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Per token: softmax over all experts, its top k (renormalized if asked), sum of weight * SwiGLU expert."""
    args, w13, w2 = moe.args, moe.experts.w13, moe.experts.w2
    out = torch.zeros_like(x)
    for t in range(len(x)):
        probs = torch.softmax(x[t] @ moe.gate.weight.t(), dim=-1)
        top = probs.topk(args.top_k)
        weights = top.values / top.values.sum() if args.renormalize else top.values
        for w, e in zip(weights.tolist(), top.indices.tolist(), strict=True):
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += w * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_block_matches_the_per_token_reference_with_an_idle_expert(renormalize: bool) -> None:
    args = MoeArgs(num_experts=4, top_k=2, intermediate_size=8, renormalize=renormalize, fp32_weights=False)
    moe, x = seeded(block(args), seed=1), inputs(seed=2)
    routing = route(moe.gate(x), args)
    assert torch.bincount(routing.experts.flatten(), minlength=4).tolist()[3] == 0  # expert 3 gets no token
    assert set(routing.experts.flatten().tolist()) == {0, 1, 2}
    sums = routing.weights.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums)) == renormalize
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-5, atol=1e-5)


def test_tp_slices_of_the_experts_sum_to_the_whole_block() -> None:
    """Each rank's w13 holds its slice of every expert's gate rows then up rows, w2 the same columns; the
    ranks' partial outputs (what the all-reduce sums) add up to the unsharded block's output."""
    args = MoeArgs(num_experts=4, top_k=2, intermediate_size=8, renormalize=True, fp32_weights=True)
    whole, x = seeded(block(args), seed=3), inputs(seed=4)
    routing = route(whole.gate(x), args)
    partial = torch.zeros_like(x)
    for rank in range(2):
        part = block(args, rank, 2).experts
        rows = slice(4 * rank, 4 * rank + 4)
        with torch.no_grad():
            gate, up = whole.experts.w13.chunk(2, dim=1)
            part.w13.copy_(torch.cat([gate[:, rows], up[:, rows]], dim=1))
            part.w2.copy_(whole.experts.w2[:, :, rows])
        assert part.w13.shape == (4, 8, HIDDEN) and part.w2.shape == (4, HIDDEN, 4)
        partial += part(x, routing)
    torch.testing.assert_close(partial, whole(x), rtol=1e-5, atol=1e-6)


def expert_weights(model: torch.nn.Module, layer: int) -> FusedExperts:
    return model.get_submodule(f"model.layers.{layer}.mlp.experts")  # type: ignore[return-value]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_each_rank_holds_its_slice_of_every_expert(
    family: str, load_format: str, request: pytest.FixtureRequest
) -> None:
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    cfg = ModelConfig.from_pretrained(model_dir, load_format=load_format, seed=5)  # type: ignore[arg-type]
    whole = expert_weights(build(cfg, 0, 1), 0)
    gate, up = whole.w13.chunk(2, dim=1)  # [E, I, H] each
    inter = whole.args.intermediate_size // 2
    for rank in range(2):
        part = expert_weights(build(cfg, rank, 2), 0)
        rows = slice(rank * inter, (rank + 1) * inter)
        assert torch.equal(part.w13, torch.cat([gate[:, rows], up[:, rows]], dim=1))
        assert torch.equal(part.w2, whole.w2[:, :, rows])


def test_checkpoint_experts_land_in_the_stacked_weights(tiny_mixtral_dir: Path) -> None:
    from safetensors.torch import load_file

    checkpoint = load_file(str(tiny_mixtral_dir / "model.safetensors"))
    experts = expert_weights(build(ModelConfig.from_pretrained(tiny_mixtral_dir), 0, 1), 1)
    prefix = "model.layers.1.block_sparse_moe.experts.2"
    w1, w3, w2 = (checkpoint[f"{prefix}.w{i}.weight"] for i in (1, 3, 2))
    assert torch.equal(experts.w13[2], torch.cat([w1, w3])) and torch.equal(experts.w2[2], w2)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_family_at_tp_2_matches_transformers(family: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Chunked prefill forced (7 tokens), prefix caching on: two requests at a time, so the third prompt starts
    after the first is done and finds the 37 tokens they share (two 16-token blocks) cached."""
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    prefix = random_prompts(1024, [37], seed=70)[0]
    first, third = (prefix + p for p in random_prompts(1024, [4, 27], seed=72))
    prompts = [first, random_prompts(1024, [3], seed=71)[0], third]
    chunked = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, prefill_chunk_size=7)
    got = tp_greedy(model_dir, prompts, 2, tmp_path, scheduler=chunked, max_tokens=TP_NEW_TOKENS)
    assert got == hf_greedy(model_dir, prompts, TP_NEW_TOKENS)


def test_stacked_expert_checkpoints_load_as_the_per_expert_ones(tiny_qwen3_moe_dir: Path, tmp_path: Path) -> None:
    """transformers' in-memory names (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) in a
    checkpoint fill the same weights, at TP 1 and in each rank's slices at TP 2."""
    from safetensors.torch import save_file

    from tests.hf_reference import hf_model

    state = hf_model(str(tiny_qwen3_moe_dir)).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (tmp_path / "config.json").write_text((tiny_qwen3_moe_dir / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        ours = build(ModelConfig.from_pretrained(tmp_path), rank, size)
        theirs = build(ModelConfig.from_pretrained(tiny_qwen3_moe_dir), rank, size)
        for name, param in theirs.named_parameters():
            assert torch.equal(ours.get_parameter(name), param), name


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_exported_weights_are_transformers_in_memory_state_dict(family: str, request: pytest.FixtureRequest) -> None:
    """unmerged_state_dict of an MoE model: every name and tensor of transformers' own model (stacked experts)."""
    from pdserve.core.models.loading import unmerged_state_dict
    from tests.hf_reference import hf_model

    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    theirs = hf_model(str(model_dir)).state_dict()
    ours = unmerged_state_dict(build(ModelConfig.from_pretrained(model_dir), 0, 1))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
