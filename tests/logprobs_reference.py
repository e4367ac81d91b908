"""Hugging Face transformers as the reference for logprobs: fp32 logits of prompt + generated tokens."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from pdserve.core.engine import Engine, RequestOutput
from pdserve.core.sampling_params import SamplingParams
from tests.hf_reference import hf_model

_run_ids = itertools.count()

TOLERANCE = 1e-4
"""Largest difference allowed between a served logprob and the reference's (fp32 on both sides)."""


class ReferenceLogprobs(NamedTuple):
    """Per generated token: its log-probability, and the top ids and log-probabilities at its position."""

    chosen: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def hf_logprobs(
    model_dir: str | Path, prompt: Sequence[int], generated: Sequence[int], num_top: int, temperature: float = 1.0
) -> ReferenceLogprobs:
    """log_softmax(logits / temperature) of one forward pass over prompt + generated, at the position that
    predicts each generated token."""
    ids = torch.tensor([[*prompt, *generated]])
    with torch.no_grad():
        logits = hf_model(str(model_dir))(ids).logits[0].float()  # [len(ids), vocab]
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]  # [len(generated), vocab]
    logp = torch.log_softmax(rows / temperature, dim=-1)
    chosen = logp.gather(1, torch.tensor(list(generated))[:, None]).squeeze(1)
    top_logprobs, top_ids = logp.topk(num_top, dim=-1)
    return ReferenceLogprobs(chosen.tolist(), top_ids.tolist(), top_logprobs.tolist())


def assert_matches(
    chosen: Sequence[float], top_ids: Sequence[Sequence[int]], top_logprobs: Sequence[Sequence[float]],
    ref: ReferenceLogprobs,
) -> None:  # fmt: skip
    """Served logprobs == the reference within TOLERANCE, token by token; top ids exactly."""
    assert len(chosen) == len(ref.chosen)
    for i, (got, want) in enumerate(zip(chosen, ref.chosen, strict=True)):
        assert abs(got - want) <= TOLERANCE, f"token {i}: logprob {got} vs {want}"
    assert [list(t) for t in top_ids] == ref.top_ids
    for i, (got_row, want_row) in enumerate(zip(top_logprobs, ref.top_logprobs, strict=True)):
        worst = max((abs(g - w) for g, w in zip(got_row, want_row, strict=True)), default=0.0)
        assert worst <= TOLERANCE, f"token {i}: top logprobs {got_row} vs {want_row}"


def run_requests(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[RequestOutput]]:
    """Each prompt's outputs, in order, from one engine run to completion (the outputs of every step kept)."""
    ids = [f"lp{next(_run_ids)}" for _ in prompts]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    engine.flush_commits()
    return [outs[rid] for rid in ids]


def assert_outputs_match(
    model_dir: Path, prompt: list[int], outs: list[RequestOutput], num_top: int, temperature: float = 1.0
) -> int:
    """One request's engine logprobs == transformers' (one entry per token); the number of tokens."""
    tokens = [t for o in outs for t in o.new_token_ids]
    entries = [e for o in outs for e in (o.logprobs or [])]
    assert len(entries) == len(tokens)
    ref = hf_logprobs(model_dir, prompt, tokens, num_top, temperature)
    assert_matches([e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries], ref)
    return len(tokens)
