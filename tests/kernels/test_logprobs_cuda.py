"""Logprobs on CUDA in fp32 (no tf32): prefill, overlapped decode steps (eager and in CUDA graphs) whose host copies
land late, and an exact hit, each token's logprob and top 5 == transformers fp32 within 1e-4; rows that do not ask
get none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine, InFlightStep, RequestOutput
from pdserve.core.sampler import HostLogprobs, TokenLogprobs
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.scheduler import StepPlan
from tests.hf_reference import random_prompts
from tests.logprobs_reference import assert_outputs_match, run_requests

pytestmark = pytest.mark.gpu
TOP = 5
NEW_TOKENS = 16
STALL_CYCLES = 20_000_000
"""A GPU sleep of about 10 ms: the logprobs' host copies land long after the host could have read them."""
MODES = {"triton-graphs": ("triton", False), "torch-eager": ("torch", True)}


def check(model_dir: Path, prompt: list[int], outs: list[RequestOutput], temperature: float = 1.0) -> None:
    assert assert_outputs_match(model_dir, prompt, outs, TOP, temperature) == NEW_TOKENS


@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_logprobs_match_hf_on_every_path(mode: str, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    backend, eager = MODES[mode]
    launched: list[int] = []
    launch, copy = Engine._launch_decode, HostLogprobs.copy

    def counted_launch(engine: Engine, plan: StepPlan) -> InFlightStep:
        launched.append(len(plan.chunks))
        return launch(engine, plan)

    def stalled_copy(host: HostLogprobs, lp: TokenLogprobs) -> TokenLogprobs:
        torch.cuda._sleep(STALL_CYCLES)
        return copy(host, lp)

    monkeypatch.setattr(Engine, "_launch_decode", counted_launch)
    monkeypatch.setattr(HostLogprobs, "copy", stalled_copy)
    cfg = EngineConfig(
        ModelConfig.from_pretrained(tiny_llama_dir),
        CacheConfig(num_blocks=256),
        SchedulerConfig(max_num_seqs=4),
        device="cuda",
        attention_backend=backend,  # type: ignore[arg-type]
        enforce_eager=eager,
    )
    engine = Engine(cfg)
    assert (engine.runner.graphs is not None) == (not eager)
    a, b, c = random_prompts(1024, (21, 40, 7), seed=81)
    asking = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=TOP)
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    hot = SamplingParams(temperature=0.7, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=TOP)
    # rows that ask next to one that does not; unseeded sampling keeps the decode steps overlapped
    first, other, random_row = run_requests(engine, [a, b, c], [asking, plain, hot])
    assert len(launched) >= NEW_TOKENS - 2, launched
    assert all(o.logprobs is None for o in other)
    check(tiny_llama_dir, a, first)
    check(tiny_llama_dir, c, random_row, temperature=0.7)
    # an exact hit: the first token from the cached logits row, on the device
    hits = engine.stats.num_full_hits
    (again,) = run_requests(engine, [a], [asking])
    assert engine.stats.num_full_hits == hits + 1
    check(tiny_llama_dir, a, again)
