"""The engine at TP 2 on two GPUs (NCCL, rank r on GPU r), with CUDA graphs (the all-reduces and the logits'
all-gather captured inside them) and eagerly: fp32 greedy tokens equal TP 1 on one GPU and transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pdserve.core import parallel
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.engine import Engine
from pdserve.core.parallel import ParallelConfig
from pdserve.core.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, random_prompts
from tests.unit.test_tensor_parallel import NEW_TOKENS, tp_greedy

BF16_TOLERANCE = 0.08
"""Relative L2 error of bf16 last-token logits against transformers in fp32, tiny random llama (its logits are
small, so bf16 rounding weighs more than in a trained model)."""
TP_ERROR_GROWTH = 1.5
"""How much larger TP 2's bf16 error may be than TP 1's (the all-reduces sum partial products in bf16)."""

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


@pytest.mark.parametrize(
    ("family", "vocab", "eager"),
    [
        ("tiny_llama_dir", 1024, False),
        ("tiny_llama_dir", 1024, True),
        ("tiny_gpt2_dir", 50257, False),
        ("tiny_qwen3_dir", 1024, False),
        ("tiny_qwen3_moe_dir", 1024, False),
        ("tiny_qwen3_moe_dir", 1024, True),
        ("tiny_mixtral_dir", 1024, False),
        ("tiny_qwen2_moe_dir", 1024, False),
    ],
)
def test_engine_at_tp_2_on_two_gpus_matches_tp_1_and_transformers(
    family: str, vocab: int, eager: bool, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_dir = request.getfixturevalue(family)
    prompts = random_prompts(vocab, [3, 17, 40, 200], seed=81)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    one = Engine(EngineConfig(ModelConfig.from_pretrained(model_dir), CacheConfig(num_blocks=128), device="cuda:0"))
    reference = one.generate(prompts, params)
    del one
    torch.cuda.empty_cache()
    assert tp_greedy(model_dir, prompts, 2, tmp_path, device="cuda", eager=eager) == reference
    assert reference == hf_greedy(model_dir, prompts, NEW_TOKENS)


def _logits_rank(rank: int, size: int, model_dir: str, prompts: list[list[int]], out: str) -> None:
    """A bf16 engine's first pass over prompts at TP size (rank r on GPU r); rank 0 saves the last-token logits."""
    pc = ParallelConfig(size, rank)
    device = f"cuda:{rank}"
    parallel.init_tp_group(pc, f"file://{out}.rendezvous", torch.device(device))
    model = ModelConfig.from_pretrained(model_dir, dtype="bfloat16")
    engine = Engine(EngineConfig(model, CacheConfig(num_blocks=128), device=device, parallel=pc))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    logits = engine.runner.execute(engine.scheduler.schedule())  # [len(prompts), vocab] float32
    if rank == 0:
        torch.save(logits.cpu(), out)
    parallel.close_tp_group()


def test_bf16_logits_at_tp_2_within_tolerance_of_transformers_fp32(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """TP 2 in bf16 is as close to transformers' fp32 logits as TP 1 in bf16 is (relative L2 error per prompt)."""
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(1024, [3, 17, 40, 200], seed=82)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).cuda().eval()  # type: ignore[call-arg]
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p], device="cuda")).logits[0, -1].cpu() for p in prompts])
    errors = {}
    for size in (1, 2):
        out = tmp_path / f"logits-tp{size}.pt"
        mp.spawn(_logits_rank, args=(size, str(tiny_llama_dir), prompts, str(out)), nprocs=size, join=True)
        got = torch.load(out)
        errors[size] = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    print(f"bf16 logits, max relative L2 error vs transformers fp32: {errors}")
    assert errors[1] < BF16_TOLERANCE and errors[2] < min(BF16_TOLERANCE, TP_ERROR_GROWTH * errors[1])


def _one_shot_rank(rank: int, out: str) -> None:
    """Rank r of 2 on GPU r: sums through TPGroup with the one-shot kernel on, eagerly and in a CUDA graph."""
    device = torch.device(f"cuda:{rank}")
    group = parallel.init_tp_group(ParallelConfig(2, rank), f"file://{out}.rendezvous", device)
    on = group.use_symmetric_memory("one_shot", 8, 64, torch.bfloat16, device)
    small = torch.full((8, 64), rank + 1.0, dtype=torch.bfloat16, device=device)
    large = torch.full((16, 64), rank + 1.0, dtype=torch.bfloat16, device=device)  # NOTE: past the buffer: NCCL
    minimum = torch.tensor([rank + 5], dtype=torch.int64, device=device)
    eager = [group.all_reduce(small.clone())[0, 0].item(), group.all_reduce(large.clone())[0, 0].item(),
             group.all_reduce(minimum.clone(), dist_min())[0].item()]  # fmt: skip
    graph, x = torch.cuda.CUDAGraph(), small.clone()
    with torch.cuda.graph(graph):
        for _ in range(4):  # NOTE: chained on one buffer: each call must wait for the peers' previous reads
            group.all_reduce(x)
    x.copy_(small)
    graph.replay()
    torch.cuda.synchronize(device)
    if rank == 0:
        torch.save({"on": on, "eager": eager, "graph": x.float().unique().tolist()}, out)
    parallel.close_tp_group()


def dist_min() -> torch.distributed.ReduceOp.RedOpType:
    return torch.distributed.ReduceOp.MIN


def test_one_shot_all_reduce_sums_exactly_in_a_graph_and_leaves_larger_messages_and_min_to_nccl(
    tmp_path: Path,
) -> None:
    out = tmp_path / "one_shot.pt"
    mp.spawn(_one_shot_rank, args=(str(out),), nprocs=2, join=True)
    got = torch.load(out)
    assert got["on"] is True
    assert got["eager"] == [3.0, 3.0, 5]
    assert got["graph"] == [3.0 * 2**3]  # NOTE: (1 + 2) then doubled by each of the 3 later sums: exact in bf16


FUSED_ROWS, FUSED_HIDDEN = 64, 4096
"""The fused kernel's buffer in the test: a decode batch of 64 rows of the 8B shape's width."""


def _partials(rows: int, call: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Every rank's partial sums of one call (each rank makes all of them, from seeds): [rows, hidden] each."""
    gen = torch.Generator(device="cpu").manual_seed(1000 * call + rows)
    return [torch.randn(rows, FUSED_HIDDEN, generator=gen).to(dtype=dtype, device=device) for _ in range(2)]


Outputs = list[tuple[torch.Tensor, torch.Tensor]]


def _eager_then_replayed(run: Callable[[], Outputs], replays: int = 3) -> list[Outputs]:
    """run()'s (out, residual) pairs eagerly, then from a CUDA graph capturing it, replayed `replays` times (cloned
    after each replay)."""
    eager = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    results = [eager]
    for _ in range(replays):
        graph.replay()
        results.append([(o.clone(), r.clone()) for o, r in captured])
    return results


def _fused_rank(rank: int, out: str) -> None:
    """Rank r of 2 on GPU r: all_reduce_rms_norm over the fused kernel (eager, then chained in a CUDA graph with
    different row counts, then eager again) against the sum in rank order and the separate norm kernel."""
    from pdserve.kernels.fused_ops import rms_norm_triton

    device, dtype, eps = torch.device(f"cuda:{rank}"), torch.bfloat16, 1e-5
    group = parallel.init_tp_group(ParallelConfig(2, rank), f"file://{out}.rendezvous", device)
    on = group.use_symmetric_memory("fused", FUSED_ROWS, FUSED_HIDDEN, dtype, device)
    weight = torch.randn(FUSED_HIDDEN, generator=torch.Generator().manual_seed(7)).to(dtype=dtype, device=device)
    calls = [(1, 0), (64, 1), (7, 2), (64, 3)]  # (rows, seed)
    inputs = {c: _partials(rows, c, dtype, device) for rows, c in calls}
    inputs[2][0][:, :64] = -0.0  # NOTE: the kernel's "not written yet" mark: it must travel as +0.0, not hang
    inputs[2][1][:, :32] = -0.0
    residuals = {c: _partials(rows, 100 + c, dtype, device)[0] for rows, c in calls}  # alike on every rank

    def run() -> Outputs:
        return [group.all_reduce_rms_norm(inputs[c][rank], residuals[c], weight, eps) for _, c in calls]

    runs = [*_eager_then_replayed(run), run()]
    torch.cuda.synchronize(device)
    mismatches = 0
    for results in runs:
        for (_, c), (got_out, got_res) in zip(calls, results, strict=True):
            total = (inputs[c][0].float() + inputs[c][1].float()).to(dtype)
            want_out, want_res = rms_norm_triton(total, weight, eps, residuals[c])
            mismatches += int(not torch.equal(got_out, want_out)) + int(not torch.equal(got_res, want_res))
    mismatches += _pushed_mismatches(group, rank, weight, eps)
    larger = _partials(FUSED_ROWS + 1, 9, dtype, device)
    res = _partials(FUSED_ROWS + 1, 109, dtype, device)[0]
    fallback_out, _ = group.all_reduce_rms_norm(larger[rank].clone(), res, weight, eps)  # NOTE: past the buffer
    want_fallback, _ = rms_norm_triton((larger[0].float() + larger[1].float()).to(dtype), weight, eps, res)
    torch.cuda.synchronize(device)
    if rank == 0:
        fallback_equal = torch.equal(fallback_out, want_fallback)
        torch.save({"on": on, "mismatches": mismatches, "fallback_equal": fallback_equal}, out)
    parallel.close_tp_group()


def _pushed_mismatches(group: parallel.TPGroup, rank: int, weight: torch.Tensor, eps: float) -> int:
    """One-row partials made by kernels/gemv.py, which writes them into the peers' buffers itself (push_target),
    summed by the fused kernel, between unpushed calls of 64 rows: eagerly and in 3 graph replays, against the sum
    in rank order and the norm kernel (every rank computes both ranks' partials: the GEMV's bits are the same)."""
    from pdserve.kernels.fused_ops import rms_norm_triton
    from pdserve.kernels.gemv import gemv

    device, dtype, k = weight.device, weight.dtype, 1024
    gen = torch.Generator(device="cpu").manual_seed(77)
    ws = [(torch.randn(FUSED_HIDDEN, k, generator=gen) * k**-0.5).to(device=device, dtype=dtype) for _ in range(2)]
    x = torch.randn(1, k, generator=gen).to(device=device, dtype=dtype)
    res = torch.randn(1, FUSED_HIDDEN, generator=gen).to(device=device, dtype=dtype)
    big, big_res = _partials(FUSED_ROWS, 50, dtype, device), _partials(FUSED_ROWS, 51, dtype, device)[0]

    def pushed() -> tuple[torch.Tensor, torch.Tensor]:
        target = group.push_target(1, FUSED_HIDDEN, dtype)
        assert target is not None
        local = gemv(x, ws[rank], push=target)
        group.note_pushed(local)
        return group.all_reduce_rms_norm(local, res, weight, eps)

    def run() -> Outputs:
        return [pushed(), group.all_reduce_rms_norm(big[rank], big_res, weight, eps), pushed(), pushed()]

    runs = _eager_then_replayed(run)
    torch.cuda.synchronize(device)
    one = rms_norm_triton((gemv(x, ws[0]).float() + gemv(x, ws[1]).float()).to(dtype), weight, eps, res)
    many = rms_norm_triton((big[0].float() + big[1].float()).to(dtype), weight, eps, big_res)
    mismatches = 0
    for results in runs:
        for (got_out, got_res), (want_out, want_res) in zip(results, [one, many, one, one], strict=True):
            mismatches += int(not torch.equal(got_out, want_out)) + int(not torch.equal(got_res, want_res))
    return mismatches


def test_fused_all_reduce_rms_norm_equals_the_sum_then_the_norm_eagerly_and_in_a_graph(tmp_path: Path) -> None:
    out = tmp_path / "fused.pt"
    mp.spawn(_fused_rank, args=(str(out),), nprocs=2, join=True)
    got = torch.load(out)
    assert got["on"] is True
    assert got["mismatches"] == 0
    assert got["fallback_equal"] is True
