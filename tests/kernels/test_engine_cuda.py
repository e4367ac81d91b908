"""The engine on CUDA in fp32 (IEEE, no tf32) with the torch backend, the Triton kernels eager and the
Triton kernels in CUDA graphs: tokens equal transformers on the same GPU and first-token logits agree within
tolerance."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.decode_batch import DecodeBatch
from pdserve.core.engine import Engine
from pdserve.core.prefill_staging import HostInputs
from pdserve.core.request import Request
from pdserve.core.sampler import SamplingState
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.scheduler import ScheduledChunk, StepPlan
from tests.hf_reference import random_prompts
from tests.passes import every_row_logits, prompt_plan, record_mixed_splits

pytestmark = pytest.mark.gpu
NEW_TOKENS = 32
STALL_CYCLES = 20_000_000
"""A GPU sleep of about 10 ms: far longer than the host takes to stage the next decode step."""


def hf_greedy_cuda(model_dir: Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()  # type: ignore[call-arg]
    tokens, logits = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens.append(out.sequences[0, len(prompt) :].tolist())
        logits.append(out.logits[0][0].float().cpu())
    return tokens, logits


MODES = {"torch": ("torch", True), "triton-eager": ("triton", True), "triton-graphs": ("triton", False)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])  # qwen3: q/k head norms before the kernels' rope
def test_cuda_fp32_greedy_matches_hf_on_gpu(family: str, mode: str, request: pytest.FixtureRequest) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    backend, eager = MODES[mode]
    cfg = EngineConfig(
        ModelConfig.from_pretrained(model_dir),
        CacheConfig(num_blocks=256),
        # graph sizes 1, 2, 4, 6: 8 prompts run as 6 then 2, mixed with prefill chunks (eager) on the way
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, prefill_chunk_size=16),
        device="cuda",
        attention_backend=backend,  # type: ignore[arg-type]
        enforce_eager=eager,
    )
    engine = Engine(cfg)
    assert (engine.runner.graphs is not None) == (mode == "triton-graphs")
    prompts = random_prompts(1024, (1, 5, 17, 33, 64, 100, 3, 48), seed=41)
    expected, first_logits = hf_greedy_cuda(model_dir, prompts)
    assert engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)) == expected
    # first-token logits of a fresh prefill, compared with transformers' on the same GPU
    fresh = Engine(replace(cfg, scheduler=SchedulerConfig()))
    fresh.add_request("x", prompts[4], SamplingParams(temperature=0.0, max_tokens=1))
    plan = fresh.scheduler.schedule()
    ours = fresh.runner.execute(plan)[0].cpu()
    torch.testing.assert_close(ours, first_logits[4], rtol=1e-4, atol=1e-4)


def chunked_triton_cfg(model_dir: Path, max_num_seqs: int, eager: bool) -> EngineConfig:
    """The Triton backend with chunks of 16 in passes of 64 tokens: prompts prefill beside running decodes."""
    return EngineConfig(
        ModelConfig.from_pretrained(model_dir),
        CacheConfig(num_blocks=256),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, prefill_chunk_size=16),
        device="cuda",
        attention_backend="triton",
        enforce_eager=eager,
    )


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_mixed_passes_split_their_decodes_and_match_hf(tiny_llama_dir: Path, eager: bool) -> None:
    """A decode worker's passes of prompt chunks beside running decodes run the decodes on the decode kernel (a
    prefill graph's decode slots, or an eager split): tokens equal transformers and no block leaks."""
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = Engine(chunked_triton_cfg(tiny_llama_dir, max_num_seqs=12, eager=eager))
    splits = record_mixed_splits(engine.runner)  # decodes of each mixed pass (eager ones, then graphed ones)
    if not eager:
        graphs = engine.runner.prefill_graphs
        assert graphs is not None and graphs.staging.decode_slots == 12
        run = graphs.run

        def spy_run(host: HostInputs, num_decodes: int) -> torch.Tensor:
            splits.append(num_decodes)
            return run(host, num_decodes)

        graphs.run = spy_run  # type: ignore[method-assign]
    prompts = random_prompts(1024, (70, 3, 40, 9, 1, 55, 100, 20, 33, 5), seed=49)
    expected, _ = hf_greedy_cuda(tiny_llama_dir, prompts)
    assert engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)) == expected
    assert max(splits) >= 4  # passes of several decodes beside a chunk ran this way
    assert engine.pool.num_used_blocks == 0


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_cuda_fp32_moe_matches_hf_on_gpu(family: str, eager: bool, request: pytest.FixtureRequest) -> None:
    """The MoE families with the fused MoE kernels (kernels/fused_moe.py), decode and prefill passes in CUDA
    graphs or eager: tokens equal transformers on the same GPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    engine = Engine(chunked_triton_cfg(model_dir, max_num_seqs=6, eager=eager))
    assert (engine.runner.graphs is None) == (engine.runner.prefill_graphs is None) == eager
    prompts = random_prompts(1024, (1, 17, 33, 64, 3, 100), seed=43)
    expected, _ = hf_greedy_cuda(model_dir, prompts)
    assert engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)) == expected


def test_cuda_prefix_cache_and_seeded_sampling(tiny_llama_dir: Path) -> None:
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=128), device="cuda")
    engine = Engine(cfg)
    (prompt,) = random_prompts(1024, (53,), seed=42)
    params = SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=16, ignore_eos=True)
    first = engine.generate([prompt], params)
    calls = engine.num_forward_calls
    again = engine.generate([prompt], SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=1))
    assert engine.num_forward_calls == calls  # whole-prompt hit: first token from cached last_logits
    assert again[0] == first[0][:1]
    assert engine.generate([prompt], params) == first
    assert engine.pool.num_used_blocks == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
def test_half_precision_logits_match_hf_on_gpu(family: str, dtype: str, request: pytest.FixtureRequest) -> None:
    """The model cast whole to bf16/fp16 (the Triton backend and fused kernels): last-token logits of a batch
    of prefills agree with transformers in the same dtype on the same GPU, within half-precision tolerance."""
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    cfg = EngineConfig(ModelConfig.from_pretrained(model_dir, dtype=dtype), CacheConfig(num_blocks=128), device="cuda")
    engine = Engine(cfg)
    prompts = random_prompts(1024, (3, 17, 40, 96), seed=43)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    ours = engine.runner.execute(engine.scheduler.schedule()).float().cpu()  # [4, vocab]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).cuda().eval()  # type: ignore[call-arg]
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p], device="cuda")).logits[0, -1].float().cpu() for p in prompts])
    assert ours.shape == want.shape
    scale = want.abs().max().item()
    torch.testing.assert_close(ours, want, rtol=0, atol=0.03 * scale)
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


def test_prefill_graphs_equal_eager_passes(tiny_llama_dir: Path) -> None:
    """Graphed prefill passes (padded tokens and sequences) give the eager passes' logits: several sequences in
    one pass over a cached prefix; passes of more sequences than a graph holds fall back to eager."""
    torch.backends.cuda.matmul.allow_tf32 = False
    base = EngineConfig(
        ModelConfig.from_pretrained(tiny_llama_dir),
        CacheConfig(num_blocks=512),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096),
        device="cuda",
    )
    graphed, eager = Engine(base), Engine(replace(base, enforce_eager=True))
    assert graphed.runner.prefill_graphs is not None and eager.runner.prefill_graphs is None
    (prefix,) = random_prompts(1024, (40,), seed=44)
    prompts = [prefix + p for p in random_prompts(1024, (3, 17, 30), seed=45)]
    prompts += random_prompts(1024, (1, 100, 300), seed=46)
    logits = []
    for engine in (graphed, eager):
        engine.generate([prefix], SamplingParams(temperature=0.0, max_tokens=1))  # caches the prefix's 2 blocks
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
        plan = engine.scheduler.schedule()
        assert len(plan.chunks) == 6 and plan.num_tokens == sum(map(len, prompts)) - 3 * 32
        logits.append(engine.runner.execute(plan).cpu())
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    many = random_prompts(1024, [5 + 3 * i for i in range(12)], seed=47)  # 12 sequences: more than a graph holds
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    fresh = [Engine(base), Engine(replace(base, enforce_eager=True))]
    assert fresh[0].generate(many, params) == fresh[1].generate(many, params)


def test_prefill_graph_passes_launched_back_to_back_keep_their_inputs(tiny_llama_dir: Path) -> None:
    """Graphed passes launched without reading their logits in between (as the warm-up does) each run on their
    own inputs: the pinned staging is not rewritten under a copy still queued behind a busy GPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    base = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=256), device="cuda")
    graphed, eager = Engine(base), Engine(replace(base, enforce_eager=True))
    prompts = random_prompts(1024, (200, 30, 300, 9), seed=48)

    def plan_for(engine: Engine, prompt: list[int]) -> StepPlan:
        req = Request(f"p{len(prompt)}", list(prompt), len(prompt), SamplingState(SamplingParams(), ()))
        req.block_ids.extend(engine.pool.allocate(-(-len(prompt) // 16)))
        return StepPlan(chunks=[ScheduledChunk(req, len(prompt))])

    graphed_plans = [plan_for(graphed, p) for p in prompts]
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        busy = busy @ busy / 64  # NOTE: keeps the stream busy so the passes below queue behind it
    outs = [graphed.runner.execute(plan).clone() for plan in graphed_plans]  # no host sync in between
    for out, prompt in zip(outs, prompts, strict=True):
        torch.testing.assert_close(out, eager.runner.execute(plan_for(eager, prompt)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_prefill_last_layer_on_sampling_rows_matches_every_row(tiny_llama_dir: Path, eager: bool) -> None:
    """Triton passes of sampling and non-sampling chunks (the last layer on the 3 sampling rows, as a decode
    pass) give the logits of the same pass run over every token, and cache the same K/V."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=256), device="cuda")
    engine = Engine(replace(cfg, enforce_eager=eager))
    assert (engine.runner.prefill_graphs is None) == eager
    prompts = random_prompts(1024, (37, 50, 5, 300), seed=49)
    plan = prompt_plan(engine, prompts, (37, 20, 5, 300))
    engine.runner.kv_pool.zero_()
    rows = engine.runner.execute(plan).clone()
    kv = engine.runner.kv_pool[:, :, 1:].clone()  # NOTE: graph padding writes the null block 0
    engine.runner.kv_pool.zero_()
    want = every_row_logits(engine.runner, plan)
    assert rows.shape == want.shape == (3, 1024)
    torch.testing.assert_close(rows, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv, engine.runner.kv_pool[:, :, 1:], rtol=1e-4, atol=1e-4)
    assert kv[-1].abs().sum() > 0


def test_overlapped_decode_steps_keep_their_inputs_on_a_busy_gpu(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each decode step's input copies wait on the GPU behind a stall (as when another process has the GPU, or an
    MPS server cleans up a killed client) while the host, which waited only for the previous step's tokens,
    stages the step after: every step must still run on its own inputs, so tokens equal transformers'."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = random_prompts(1024, (5, 17, 33, 3), seed=43)
    expected, _ = hf_greedy_cuda(tiny_llama_dir, prompts)
    copy_inputs, launch = DecodeBatch._to_device, Engine._launch_decode
    launched: list[int] = []

    def stalled_copies(batch: DecodeBatch, padded: int, tables_dirty: bool) -> None:
        torch.cuda._sleep(STALL_CYCLES)
        copy_inputs(batch, padded, tables_dirty)

    def counted_launch(engine: Engine, plan: StepPlan):  # type: ignore[no-untyped-def]
        launched.append(len(plan.chunks))
        return launch(engine, plan)

    monkeypatch.setattr(DecodeBatch, "_to_device", stalled_copies)
    monkeypatch.setattr(Engine, "_launch_decode", counted_launch)
    cfg = EngineConfig(ModelConfig.from_pretrained(tiny_llama_dir), CacheConfig(num_blocks=256), device="cuda")
    engine = Engine(cfg)
    got = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert len(launched) >= NEW_TOKENS - 2, launched  # NOTE: the decode steps ran overlapped, each behind a stall
    assert got == expected


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_short_passes_after_long_cached_prefixes_split_and_match_hf_on_gpu(
    tmp_path: Path, eager: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chat turns after a long cached history: two prompts of 2400 cached tokens plus 100 and 7 new ones run as
    one split prefill pass (kernels/prefill_splits.py; graphed: the split variant of the 128-token graph) and
    then decode; greedy tokens equal transformers' on the same GPU in fp32."""
    from pdserve.core import prefill_graphs
    from pdserve.kernels import triton_backend
    from pdserve.kernels.split_policy import NUM_SPLITS
    from tests.models import make_tiny_llama

    torch.backends.cuda.matmul.allow_tf32 = False
    splits: list[int] = []

    def recorded(choose: Callable[[int, int], int]) -> Callable[[int, int], int]:
        def choose_and_record(num_tokens: int, max_prefix_len: int) -> int:
            splits.append(choose(num_tokens, max_prefix_len))
            return splits[-1]

        return choose_and_record

    for module in (prefill_graphs, triton_backend):
        monkeypatch.setattr(module, "choose_num_splits", recorded(module.choose_num_splits))
    model_dir = make_tiny_llama(tmp_path, seed=3, max_position_embeddings=4096)
    cfg = EngineConfig(
        ModelConfig.from_pretrained(model_dir), CacheConfig(num_blocks=1024), device="cuda", enforce_eager=eager
    )
    engine = Engine(cfg)
    (history,) = random_prompts(1024, (2400,), seed=50)
    prompts = [history + turn for turn in random_prompts(1024, (100, 7), seed=51)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.generate([history + [5]], params)  # caches the history's 150 blocks
    splits.clear()
    assert engine.generate(prompts, params) == hf_greedy_cuda(model_dir, prompts)[0]
    assert NUM_SPLITS in splits
    assert engine.pool.num_used_blocks == 0
