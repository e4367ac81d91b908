"""The fused MoE kernels (kernels/fused_moe.py) on CPU tensors under Triton's interpreter, in a subprocess: the
device-side sort against its torch reference exactly, and the whole pass against the torch loop (fp16 and fp32;
the interpreter's bf16 is not trusted) with uneven routing, an idle expert and top-k 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
CASES = [(1, 64, 32, 4, 2), (7, 64, 48, 8, 2), (33, 32, 32, 6, 3), (20, 32, 16, 4, 1)]  # tokens, H, I, E, top_k


def routed(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Renormalized top-k routing in which expert 0 gets no token."""
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 0] -= 100.0
    weights, experts = logits.softmax(-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), experts


def check_case(case: tuple[int, int, int, int, int], dtype: torch.dtype) -> None:
    """The sort exactly as its reference; the pass within a few ulps of the torch loop, for both weight dtypes."""
    from pdserve.kernels import fused_moe as kernels

    num_tokens, hidden, inter, num_experts, top_k = case
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    weights, experts = routed(num_tokens, num_experts, top_k, gen)
    block_m = kernels.moe_config(num_tokens, top_k, num_experts, dtype).block_m
    alignment = kernels.align_block_size(experts, num_experts, block_m)
    ids, blocks = kernels.align_block_size_ref(experts, num_experts, block_m)
    assert int(alignment.num_slots) == len(ids) <= len(alignment.sorted_ids)
    assert torch.equal(alignment.sorted_ids[: len(ids)], ids)
    assert torch.equal(alignment.block_experts[: len(blocks)], blocks)
    for w in (weights, weights.to(dtype)):  # Mixtral's float32 weights, Qwen3-MoE's in the activation dtype
        out = kernels.fused_moe(x, w13, w2, w, experts)
        ref = kernels.fused_moe_ref(x, w13, w2, w, experts)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out, ref, rtol=4 * eps, atol=4 * eps * ref.abs().max().item())


def check_all() -> None:
    for dtype in (torch.float16, torch.float32):
        for case in CASES:
            check_case(case, dtype)


def test_interpreted_kernels_match_the_torch_loop() -> None:
    """Triton reads TRITON_INTERPRET when it is imported: the checks run in a fresh interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.unit.test_fused_moe_interpret import check_all; check_all()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
