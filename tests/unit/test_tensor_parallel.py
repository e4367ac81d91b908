"""Tensor parallelism in the model (core/parallel.py, core/models/layers.py): each rank's shards of a checkpoint and
of seeded dummy weights put back together are the unsharded model, and the engine at TP 2 and 4 (gloo, one
process per rank) gives the same greedy tokens as at TP 1 and as transformers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from pdserve.core import parallel
from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.core.models import load_model
from pdserve.core.models.layers import MergedLinear
from pdserve.core.parallel import ParallelConfig, TPGroup
from pdserve.core.sampling_params import SamplingParams
from pdserve.kernels.attention import TorchAttention
from tests.hf_reference import hf_greedy, random_prompts

NEW_TOKENS = 12


def build(model_cfg: ModelConfig, rank: int, size: int) -> nn.Module:
    """The model as rank of a TP group of size would build it (construction needs no collectives)."""
    before = parallel._GROUP
    parallel._GROUP = TPGroup(rank, size)
    try:
        return load_model(model_cfg, TorchAttention(), "cpu")
    finally:
        parallel._GROUP = before


def rejoined(ranks: list[nn.Module], name: str) -> torch.Tensor:
    """Parameter `name` put back together from every rank's shard (replicated KV heads taken once)."""
    module_name = name.rpartition(".")[0]
    params = [dict(m.named_parameters())[name] for m in ranks]
    module = dict(ranks[0].named_modules())[module_name]
    if isinstance(module, MergedLinear):
        parts = []
        for part in module.sources:
            pieces = {}
            for m in ranks:
                merged = dict(m.named_modules())[module_name]
                first, rows = merged.shard_rows(part)
                pieces[merged.sources[part].start] = dict(m.named_parameters())[name][first : first + rows]
            parts.append(torch.cat([pieces[k] for k in sorted(pieces)]))
        return torch.cat(parts)
    shard = getattr(params[0], "shard", None)
    if shard is None:
        assert all(torch.equal(p, params[0]) for p in params), f"{name} differs between ranks"
        return params[0]
    kept = [p.narrow(shard.dim, 0, p.shard.length) for p in params]  # type: ignore[attr-defined]
    return torch.cat(kept, dim=shard.dim)


def unpadded(model: nn.Module, name: str) -> torch.Tensor:
    param = dict(model.named_parameters())[name]
    shard = getattr(param, "shard", None)
    return param if shard is None or shard.dim else param[: shard.full]


@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_gpt2_dir"])
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
@pytest.mark.parametrize("size", [2, 4])
def test_shards_rejoin_into_the_unsharded_model(
    family: str, load_format: str, size: int, request: pytest.FixtureRequest
) -> None:
    model_dir = request.getfixturevalue(family)
    cfg = ModelConfig.from_pretrained(model_dir, load_format=load_format, seed=3)  # type: ignore[arg-type]
    whole = build(cfg, 0, 1)
    ranks = [build(cfg, r, size) for r in range(size)]
    for name, _ in whole.named_parameters():
        assert torch.equal(rejoined(ranks, name), unpadded(whole, name)), name
    heads = {m.num_heads for m in ranks[-1].modules() if hasattr(m, "num_heads")}
    assert heads == {cfg.num_heads // size}


def test_a_tp_size_the_heads_do_not_allow_is_refused(tiny_llama_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by the TP size 3"):
        build(cfg, 0, 3)


def _rank_main(
    rank: int,
    size: int,
    model_dir: str,
    prompts: list[list[int]],
    out: str,
    device: str,
    eager: bool,
    scheduler: SchedulerConfig,
    max_tokens: int,
) -> None:
    torch.set_num_threads(1)
    pc = ParallelConfig(size, rank)
    device = f"cuda:{rank}" if device == "cuda" else device
    parallel.init_tp_group(pc, f"file://{out}.rendezvous", torch.device(device))
    model = ModelConfig.from_pretrained(model_dir)
    cache = CacheConfig(num_blocks=128)
    cfg = EngineConfig(model, cache, scheduler, device=device, enforce_eager=eager, parallel=pc)
    engine = Engine(cfg)
    tokens = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    parallel.close_tp_group()
    if rank == 0:
        Path(out).write_text(json.dumps(tokens))


def tp_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    size: int,
    tmp_path: Path,
    device: str = "cpu",
    eager: bool = False,
    scheduler: SchedulerConfig | None = None,
    max_tokens: int = NEW_TOKENS,
) -> list[list[int]]:
    """Greedy tokens of an engine at TP size: one process per rank (gloo on CPU; NCCL on CUDA, rank r on GPU r),
    every rank running the same steps (prefix caching on, as by default)."""
    out = tmp_path / f"tp{size}-{device}-{eager}.json"
    args = (size, str(model_dir), prompts, str(out), device, eager, scheduler or SchedulerConfig(), max_tokens)
    mp.spawn(_rank_main, args=args, nprocs=size, join=True)
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.fixture(params=[("tiny_llama_dir", 1024, 2), ("tiny_llama_dir", 1024, 4), ("tiny_gpt2_dir", 50257, 2)])
def case(request: pytest.FixtureRequest) -> Iterator[tuple[Path, int, int]]:
    family, vocab, size = request.param
    yield request.getfixturevalue(family), vocab, size


def test_engine_at_tp_size_matches_tp_1_and_transformers(case: tuple[Path, int, int], tmp_path: Path) -> None:
    model_dir, vocab, size = case
    prompts = random_prompts(vocab, [3, 17, 40], seed=71)
    one = Engine(EngineConfig(ModelConfig.from_pretrained(model_dir), CacheConfig(num_blocks=128)))
    reference = one.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert tp_greedy(model_dir, prompts, size, tmp_path) == reference
    assert reference == hf_greedy(model_dir, prompts, NEW_TOKENS)


@pytest.mark.slow
def test_smollm2_at_tp_3_matches_transformers(smollm2_dir: Path, tmp_path: Path) -> None:
    """SmolLM2 has 9 query and 3 KV heads: TP 3 gives each rank one KV head."""
    prompts = random_prompts(49152, [5, 30], seed=72)
    assert tp_greedy(smollm2_dir, prompts, 3, tmp_path) == hf_greedy(smollm2_dir, prompts, NEW_TOKENS)


class _StubFusedNorm:
    """Stands in for FusedAllReduceNorm (CUDA only): takes every message, records how it was called."""

    hidden, dtype, rows = 8, torch.bfloat16, 4

    def __init__(self) -> None:
        self.peer_rows = object()
        self.calls: list[bool] = []

    def fits(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.shape[-1] == self.hidden

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 pushed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        self.calls.append(pushed)
        return x, residual


def test_a_pushed_one_row_partial_is_summed_without_a_second_send_and_the_protocol_is_checked() -> None:
    group = parallel.TPGroup(0, 2)
    stub = _StubFusedNorm()
    group.fused_norm = stub  # type: ignore[assignment]
    x, other = torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(1, 8, dtype=torch.bfloat16)
    weight = torch.ones(8, dtype=torch.bfloat16)
    assert group.push_target(2, 8, torch.bfloat16) is None  # NOTE: one row only
    assert group.push_target(1, 16, torch.bfloat16) is None  # another width
    assert group.push_target(1, 8, torch.float32) is None  # another dtype
    assert group.push_target(1, 8, torch.bfloat16) is stub.peer_rows
    group.note_pushed(x)
    with pytest.raises(RuntimeError, match="never summed"):
        group.push_target(1, 8, torch.bfloat16)
    group.all_reduce_rms_norm(x, x, weight, 1e-6)
    group.all_reduce_rms_norm(other, other, weight, 1e-6)
    assert stub.calls == [True, False]
    group.note_pushed(x)
    with pytest.raises(RuntimeError, match="must be of that output"):
        group.all_reduce_rms_norm(other, other, weight, 1e-6)
