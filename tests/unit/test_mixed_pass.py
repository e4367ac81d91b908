"""A pass of decodes and prefill chunks: the scheduler puts the decodes first and the model runner hands the
attention backend the split (kernels/attention.py MixedSplit), whose arrays the Triton kernels read on a GPU;
tokens stay those of transformers and no block leaks."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.core.engine import Engine
from pdserve.core.sampling_params import SamplingParams
from pdserve.kernels.attention import num_leading_decodes
from tests.hf_reference import hf_greedy, random_prompts
from tests.passes import record_mixed_splits

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(model_dir: Path) -> Engine:
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=16)
    return Engine(EngineConfig(ModelConfig.from_pretrained(model_dir), CacheConfig(num_blocks=128), sched))


def test_num_leading_decodes() -> None:
    assert num_leading_decodes([1, 1, 5, 1]) == 2
    assert num_leading_decodes([5, 1, 1]) == 0
    assert num_leading_decodes([1, 1, 1]) == 0  # a decode pass: nothing to split
    assert num_leading_decodes([7]) == 0


def test_decodes_lead_a_pass_whose_chunk_started_first(tiny_llama_dir: Path) -> None:
    """A long prompt admitted before two short ones keeps prefilling while they decode: its chunk goes last."""
    engine = make_engine(tiny_llama_dir)
    long, a, b = random_prompts(1024, (60, 5, 9), seed=11)
    for i, prompt in enumerate((long, a, b)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()  # the long prompt's first chunk of 16, and both short prompts whole
    plan = engine.scheduler.schedule()
    assert [(c.req.request_id, c.num_tokens) for c in plan.chunks] == [("r1", 1), ("r2", 1), ("r0", 16)]


def test_eager_pass_hands_the_backend_its_decodes_and_chunks(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    long, a, b = random_prompts(1024, (60, 5, 9), seed=11)
    for i, prompt in enumerate((long, a, b)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()
    runner = engine.runner
    host = runner._host_inputs(engine.scheduler.schedule())
    meta = runner._to_device(host).meta
    assert meta.mixed is not None
    decodes, chunks = meta.mixed
    assert decodes.query_lens == [1, 1] and decodes.seq_lens.tolist() == [6, 10]
    assert torch.equal(decodes.block_tables, meta.block_tables[:2])
    # the chunk's query rows count the decodes' (rows of the whole pass): [2, 18)
    assert chunks.query_start_loc.tolist() == [2, 18] and chunks.seq_lens.tolist() == [32]
    assert chunks.query_lens == [16] and chunks.max_prefix_len == 16
    assert torch.equal(chunks.block_tables, meta.block_tables[2:])
    for part in (chunks.query_start_loc, chunks.seq_lens, chunks.block_tables, decodes.seq_lens):
        assert part.data_ptr() % 16 == 0  # NOTE: Triton specializes on 16-byte alignment


def test_passes_without_leading_decodes_are_not_split(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    for i, prompt in enumerate(random_prompts(1024, (20, 1, 9), seed=12)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    plan = engine.scheduler.schedule()
    assert [c.num_tokens for c in plan.chunks] == [1, 16, 9]  # a one-token prompt leads: it is a decode
    host = engine.runner._host_inputs(plan)
    assert engine.runner._to_device(host).meta.mixed is not None
    engine = make_engine(tiny_llama_dir)
    for i, prompt in enumerate(random_prompts(1024, (20, 9), seed=12)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    host = engine.runner._host_inputs(engine.scheduler.schedule())
    assert engine.runner._to_device(host).meta.mixed is None


def test_mixed_passes_give_transformers_tokens_and_free_every_block(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    splits = record_mixed_splits(engine.runner)
    prompts = random_prompts(1024, (70, 3, 40, 9, 1, 55), seed=13)
    assert engine.generate(prompts, GREEDY) == hf_greedy(tiny_llama_dir, prompts, GREEDY.max_tokens)
    assert splits and max(splits) >= 3  # passes of several decodes beside a chunk ran
    assert engine.pool.num_used_blocks == 0
