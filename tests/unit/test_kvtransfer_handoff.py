"""Engines on kvtransfer pools: a prefill engine's shared pool is leased, pulled by an shm sink into a decode
engine and released; the tokens equal a single engine's and every block comes back."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.engine import Engine
from pdserve.core.sampler import SamplingState
from pdserve.core.sampling_params import SamplingParams
from pdserve.kvtransfer.factory import make_sink, make_source
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.pool import KVPool, allocate_kv_pool
from tests.hf_reference import random_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def engine_on_pool(cfg: EngineConfig, shared: bool) -> tuple[Engine, KVPool]:
    """An engine whose KV pool comes from allocate_kv_pool (the way the workers build theirs)."""
    pools: list[KVPool] = []

    def allocate(num_blocks: int) -> torch.Tensor:
        pools.append(allocate_kv_pool(KVLayout.from_engine_config(cfg, num_blocks), cfg.device, shared=shared))
        return pools[0].tensor

    engine = Engine(cfg, kv_allocator=allocate)
    assert engine.runner.kv_pool is pools[0].tensor
    return engine, pools[0]


def test_prefill_lease_pull_release_equals_single_engine(tiny_llama_dir: Path) -> None:
    model = ModelConfig.from_pretrained(tiny_llama_dir)
    prefill_cfg = EngineConfig(model, CacheConfig(num_blocks=48))
    decode_cfg = EngineConfig(model, CacheConfig(num_blocks=40))  # pools may differ in size
    prompts = random_prompts(1024, (5, 16, 33, 1), seed=3)
    expected = Engine(prefill_cfg).generate(prompts, PARAMS)

    prefill, prefill_pool = engine_on_pool(prefill_cfg, shared=True)
    decode, decode_pool = engine_on_pool(decode_cfg, shared=False)
    sink = make_sink("shm", decode_pool, decode_pool.layout)
    sink.open(0, make_source("shm", prefill_pool).descriptor(), prefill_pool.layout.fingerprint())
    leases = LeaseTable()
    first: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, PARAMS)
    while prefill.has_unfinished():
        for out in prefill.step():
            first[out.request_id] = out.new_token_ids[0]
            req = prefill.detach(out.request_id)
            lease_id = leases.grant(req.request_id, 0, req.block_ids, now=0.0, ttl=30.0)
            state = SamplingState(req.sampling.params, req.sampling.eos_token_ids, req.sampling.num_generated)
            adoption = decode.adopt(req.request_id, req.token_ids, req.num_prompt_tokens, state)
            assert adoption is not None
            handle = sink.pull(0, adoption.sources(req.block_ids), adoption.dst)
            assert handle.done()  # NOTE: the request may start and the lease go back only once the copy is done
            decode.start_adopted(req.request_id)
            prefill.release_blocks(leases.release([lease_id]))
    assert len(leases) == 0 and prefill.pool.num_used_blocks == 0

    rest: dict[str, list[int]] = {rid: [] for rid in first}
    while decode.has_unfinished():
        for out in decode.step():
            rest[out.request_id].extend(out.new_token_ids)
    assert [[first[f"r{i}"], *rest[f"r{i}"]] for i in range(len(prompts))] == expected
    assert decode.stats.num_prefill_tokens_computed == 0
    sink.close_all()
    prefill_pool.close()
