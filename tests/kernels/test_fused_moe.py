"""The fused MoE kernels (kernels/fused_moe.py) against the torch loop on fresh random inputs: the device-side
sort exactly, the pass in bf16 / fp16 / fp32 over token counts, top-k and expert counts with uneven routing,
bit-identical reruns and CUDA-graph replays."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fused_moe import align_block_size, align_block_size_ref, fused_moe, fused_moe_ref, moe_config

pytestmark = pytest.mark.gpu
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS = [1, 2, 7, 64, 257, 1024, 8192]
EXPERTS_TOP_K = [(8, 1), (8, 2), (60, 2), (60, 8), (128, 8)]
ROUTINGS = ["random", "one_set", "skewed"]
HIDDEN = 320
"""With the default width 96, neither a multiple of the column tiles: masked edges in both GEMMs."""


def routing(num_tokens: int, num_experts: int, top_k: int, kind: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(weights [T, K] float32 renormalized, experts [T, K] int64 distinct per token) on CUDA.
    random: uniform; one_set: every token on experts 0..K-1; skewed: most tokens on a few experts, many idle."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if kind == "one_set":
        scores[:, :top_k] += 2.0
    elif kind == "skewed":
        scores *= torch.linspace(0.01, 1.0, num_experts) ** 8
    experts = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return (weights / weights.sum(-1, keepdim=True)).cuda(), experts.cuda()


def moe_inputs(
    num_tokens: int, num_experts: int, dtype: torch.dtype, gen: torch.Generator, hidden: int = HIDDEN, inter: int = 96
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I] on CUDA, scaled to keep activations near 1."""
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return x.to("cuda", dtype), w13.to("cuda", dtype), w2.to("cuda", dtype)


def assert_matches_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> None:
    """fused_moe within 8 eps of the dtype relative to the output's magnitude (elementwise), and within one eps
    in norm, of fused_moe_ref."""
    out, ref = fused_moe(x, w13, w2, weights, experts), fused_moe_ref(x, w13, w2, weights, experts)
    eps = torch.finfo(ref.dtype).eps
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out, ref, rtol=0, atol=8 * eps * scale)
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < eps, f"relative error {err:.3g} over the whole output"


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("num_tokens", [1, 7, 257, 8192])
@pytest.mark.parametrize("experts_top_k", EXPERTS_TOP_K, ids=[f"e{e}k{k}" for e, k in EXPERTS_TOP_K])
def test_align_block_size_matches_reference(num_tokens: int, experts_top_k: tuple[int, int], kind: str) -> None:
    num_experts, top_k = experts_top_k
    _, experts = routing(num_tokens, num_experts, top_k, kind, torch.Generator().manual_seed(num_tokens))
    for block_m, chunk in ((16, None), (64, None), (16, 256), (128, 1024), (64, 4096)):
        got = align_block_size(experts, num_experts, block_m, chunk)
        ids, blocks = align_block_size_ref(experts, num_experts, block_m)
        assert int(got.num_slots) == len(ids) <= len(got.sorted_ids)
        assert torch.equal(got.sorted_ids[: len(ids)].cpu(), ids)
        assert torch.equal(got.block_experts[: len(blocks)].cpu(), blocks)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("experts_top_k", EXPERTS_TOP_K, ids=[f"e{e}k{k}" for e, k in EXPERTS_TOP_K])
def test_fused_moe_matches_reference(num_tokens: int, experts_top_k: tuple[int, int], dtype: str) -> None:
    num_experts, top_k = experts_top_k
    gen = torch.Generator().manual_seed(num_tokens * num_experts + top_k)
    x, w13, w2 = moe_inputs(num_tokens, num_experts, DTYPES[dtype], gen)
    weights, experts = routing(num_tokens, num_experts, top_k, "random", gen)
    for w in (weights, weights.to(x.dtype)):  # Mixtral's float32 weights, Qwen3-MoE's in the activation dtype
        assert_matches_reference(x, w13, w2, w, experts)


@pytest.mark.parametrize("kind", ["one_set", "skewed"])
@pytest.mark.parametrize("num_tokens", [2, 64, 1024])
def test_uneven_routing_matches_reference(num_tokens: int, kind: str) -> None:
    """All tokens on the same experts (one expert for top-1), or a few busy experts and many idle ones."""
    gen = torch.Generator().manual_seed(num_tokens)
    for num_experts, top_k in ((8, 1), (60, 8)):
        x, w13, w2 = moe_inputs(num_tokens, num_experts, torch.bfloat16, gen)
        weights, experts = routing(num_tokens, num_experts, top_k, kind, gen)
        assert_matches_reference(x, w13, w2, weights, experts)


FP32_CASES = [(1, 60, 4), (64, 60, 4), (1024, 60, 4), (1024, 8, 2), (4096, 8, 2)]  # tokens, experts, top_k


@pytest.mark.parametrize("case", FP32_CASES, ids=[f"{t}-e{e}k{k}" for t, e, k in FP32_CASES])
def test_fp32_matches_reference(case: tuple[int, int, int]) -> None:
    """IEEE fp32 dots (no tf32) at every config: only the summation order differs from cuBLAS's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    num_tokens, num_experts, top_k = case
    gen = torch.Generator().manual_seed(num_tokens)
    x, w13, w2 = moe_inputs(num_tokens, num_experts, torch.float32, gen)
    weights, experts = routing(num_tokens, num_experts, top_k, "random", gen)
    out, ref = fused_moe(x, w13, w2, weights, experts), fused_moe_ref(x, w13, w2, weights, experts)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_realistic_shape_matches_reference() -> None:
    """Qwen3-30B-A3B's expert shape (hidden 2048, width 768, 128 experts, top 8) in bf16 at each config."""
    gen = torch.Generator().manual_seed(5)
    for num_tokens in (1, 64, 4096):
        x, w13, w2 = moe_inputs(num_tokens, 128, torch.bfloat16, gen, hidden=2048, inter=768)
        weights, experts = routing(num_tokens, 128, 8, "random", gen)
        weights = weights.to(x.dtype)
        assert_matches_reference(x, w13, w2, weights, experts)


def test_reruns_and_graph_replays_are_bit_identical() -> None:
    """No atomics: two eager runs agree bit for bit, and a captured pass replayed on new routing gives the eager
    output of that routing (sizes fixed by the shapes, no host reads)."""
    num_tokens, num_experts, top_k = 96, 60, 8
    gen = torch.Generator().manual_seed(7)
    x, w13, w2 = moe_inputs(num_tokens, num_experts, torch.bfloat16, gen)
    weights, experts = routing(num_tokens, num_experts, top_k, "random", gen)
    first = fused_moe(x, w13, w2, weights, experts)
    assert torch.equal(first, fused_moe(x, w13, w2, weights, experts))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, w13, w2, weights, experts)  # NOTE: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = fused_moe(x, w13, w2, weights, experts)
    for kind in ("skewed", "one_set", "random"):
        new_weights, new_experts = routing(num_tokens, num_experts, top_k, kind, gen)
        x.copy_(torch.randn(x.shape, generator=gen).to(x))
        weights.copy_(new_weights)
        experts.copy_(new_experts)
        graph.replay()
        assert torch.equal(captured, fused_moe(x, w13, w2, weights, experts)), kind


def test_decode_counts_take_the_small_blocks() -> None:
    """Few assignments per expert (decode) group each expert's tokens in 16-row blocks."""
    assert moe_config(1, 8, 128, torch.bfloat16).block_m == 16
    assert moe_config(64, 8, 128, torch.bfloat16).block_m == 16
    assert moe_config(8192, 8, 128, torch.bfloat16).block_m >= 64
