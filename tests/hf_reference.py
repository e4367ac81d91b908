"""Hugging Face transformers as the reference: greedy continuations computed with `generate`."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


@lru_cache(maxsize=4)
def hf_model(model_dir: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def hf_greedy(model_dir: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy new tokens for each prompt, one unpadded generate call per prompt, never stopping early."""
    model = hf_model(str(model_dir))
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        with torch.no_grad():
            out = model.generate(  # type: ignore[operator]
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def random_prompts(vocab_size: int, lengths: Sequence[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
