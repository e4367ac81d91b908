"""The gate/up GEMM with SwiGLU in its epilogue (kernels/swiglu_gemm.py) against its torch reference on fresh
random inputs, and in the engine: a bf16 model on CUDA with the fused path against the same model without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.core.models import llama
from pdserve.core.sampling_params import SamplingParams
from pdserve.kernels.swiglu_gemm import FUSED_MIN_TOKENS, interleave_gate_up, swiglu_gemm, swiglu_gemm_ref
from tests.hf_reference import random_prompts
from tests.models import make_tiny_llama

pytestmark = pytest.mark.gpu
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CASES = [(1, 64, 128), (37, 64, 256), (1000, 520, 384), (4000, 2048, 8192)]  # num_tokens, hidden, intermediate
SPARE_ROWS = 8
"""NaN rows after the output's: the TMA store must clip at the token count."""


@pytest.fixture(autouse=True)
def _needs_hopper() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the fused SwiGLU GEMM needs TMA (sm_90+)")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[f"{n}x{k}x{i}" for n, k, i in CASES])
def test_fused_swiglu_gemm_matches_reference(dtype: str, case: tuple[int, int, int]) -> None:
    num_tokens, hidden, inter = case
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to("cuda", DTYPES[dtype])
    weight = (torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5).to("cuda", DTYPES[dtype])
    weight_il = interleave_gate_up(weight).contiguous()
    buf = torch.full((num_tokens + SPARE_ROWS, inter), float("nan"), dtype=x.dtype, device="cuda")
    out = swiglu_gemm(x, weight_il, out=buf[:num_tokens])
    ref = swiglu_gemm_ref(x, weight_il)
    eps = torch.finfo(x.dtype).eps
    torch.testing.assert_close(out, ref, rtol=4 * eps, atol=4 * eps)
    assert (out == ref).float().mean() > 0.95, "most outputs round exactly as the reference's"
    assert buf[num_tokens:].isnan().all(), "wrote past the token count"
    stacked = torch.nn.functional.silu(x @ weight[:inter].t()) * (x @ weight[inter:].t())
    torch.testing.assert_close(out, stacked, rtol=4 * eps, atol=4 * eps)


def test_engine_with_the_fused_mlp_matches_it_without(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 Llama on CUDA (graphs on): prompts past FUSED_MIN_TOKENS run the fused GEMM, short ones and decode
    steps cuBLAS over the interleaved weight; greedy tokens and first-token logits match the stacked layout's."""
    model_dir = make_tiny_llama(tmp_path / "llama", intermediate_size=256, max_position_embeddings=2048)
    cfg = EngineConfig(
        ModelConfig.from_pretrained(model_dir, dtype="bfloat16"),
        CacheConfig(num_blocks=512),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048),
        device="cuda",
        attention_backend="triton",
    )
    prompts = random_prompts(1024, (FUSED_MIN_TOKENS + 37, 1500, 40, 7), seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(engine: Engine) -> tuple[list[list[int]], torch.Tensor]:
        tokens = engine.generate(prompts, params)
        engine.add_request("x", prompts[0], SamplingParams(temperature=0.0, max_tokens=1))
        logits = engine.runner.execute(engine.scheduler.schedule())  # one prefill pass of the long prompt
        return tokens, logits.float().cpu()

    fused = Engine(cfg)
    interleaved = [m.gate_up_proj.interleave for m in fused.runner.model.modules() if isinstance(m, llama.LlamaMLP)]
    assert interleaved and all(interleaved), "the fused path was not taken"
    fused_tokens, fused_logits = run(fused)
    del fused
    monkeypatch.setattr(llama, "fused_swiglu_supported", lambda *_: False)
    plain = Engine(cfg)
    assert not any(m.gate_up_proj.interleave for m in plain.runner.model.modules() if isinstance(m, llama.LlamaMLP))
    plain_tokens, plain_logits = run(plain)
    assert fused_tokens == plain_tokens
    torch.testing.assert_close(fused_logits, plain_logits, rtol=0.02, atol=0.02)
