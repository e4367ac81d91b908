"""Hand-built forward passes for tests that drive a ModelRunner directly."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.core.engine import Engine
from pdserve.core.model_runner import ModelRunner
from pdserve.core.request import Request
from pdserve.core.sampler import SamplingState
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.scheduler import ScheduledChunk, StepPlan
from pdserve.kernels.attention import AttentionMetadata


def prompt_plan(engine: Engine, prompts: Sequence[Sequence[int]], num_tokens: Sequence[int]) -> StepPlan:
    """One pass over the first num_tokens[i] tokens of each prompt (fresh blocks); a chunk that stops short of
    its prompt's end does not sample."""
    chunks = []
    for i, (prompt, n) in enumerate(zip(prompts, num_tokens, strict=True)):
        req = Request(f"pass-{i}", list(prompt), len(prompt), SamplingState(SamplingParams(), ()))
        req.block_ids.extend(engine.pool.allocate(-(-len(prompt) // engine.config.cache.block_size)))
        chunks.append(ScheduledChunk(req, n))
    return StepPlan(chunks=chunks)


@torch.inference_mode()
def every_row_logits(runner: ModelRunner, plan: StepPlan) -> torch.Tensor:  # [num_sampling, vocab] float32
    """The pass run eagerly with the last layer over every token (no output rows), then its sampling rows'
    logits picked out: the reference for passes whose last layer runs on those rows alone."""
    dev = runner._to_device(runner._host_inputs(plan))
    assert dev.meta.rows is not None
    rows, dev.meta.rows = dev.meta.rows.index, None
    runner.backend.prepare(dev.meta)
    hidden = runner.model(dev.ids, dev.positions, runner.kv_caches, dev.meta)  # [num_tokens, hidden]
    return runner.model.compute_logits(hidden[rows])  # type: ignore[no-any-return, operator]


def record_mixed_splits(runner: ModelRunner) -> list[int]:
    """The decodes of every eager pass the runner hands its backend split (AttentionMetadata.mixed), appended as
    the passes run."""
    splits: list[int] = []
    prepare = runner.backend.prepare

    def spy(meta: AttentionMetadata) -> None:
        if meta.mixed is not None:
            splits.append(meta.mixed.decodes.num_seqs)
        prepare(meta)

    runner.backend.prepare = spy  # type: ignore[method-assign]
    return splits
