"""Hugging Face transformers as the reference for logprobs: fp32 logits of prompt + generated tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from tests.hf_reference import hf_model

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
