"""Tiny random model folders for tests: fast to build, deterministic per seed, decisive logits.

Weights at the default ``initializer_range`` (0.02) give nearly flat logits, so greedy argmax is
decided by rounding noise and two correct implementations can disagree. The factories re-draw every
parameter at a larger scale so the top-2 logit gap at each greedy step is usually far above 1e-3 and
the greedy continuation varies with context instead of repeating one token.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from pdserve.core.model_store import GPT2_VOCAB_SIZE, write_gpt2_tokenizer

TINY_LLAMA_VOCAB_SIZE = 1024
# NOTE: the tiny llama tokenizer is GPT-2's BPE cut to 1024 ids, with <|endoftext|> as the last id.
TINY_LLAMA_EOS_ID = TINY_LLAMA_VOCAB_SIZE - 1
WEIGHT_STD = 0.2
NORM_NOISE_STD = 0.1
BIAS_STD = 0.02


def make_tiny_llama(model_dir: Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Save a 4-layer GQA llama (hidden 64, vocab 1024) plus a 1024-token BPE tokenizer to ``model_dir``.

    ``config_overrides`` go to LlamaConfig, e.g. ``attention_bias=True`` (Qwen2-like) or
    ``rope_scaling={"rope_type": "llama3", ...}``. Tests may also pass token ids directly.
    """
    config_kwargs: dict[str, Any] = {
        "vocab_size": TINY_LLAMA_VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": TINY_LLAMA_EOS_ID,
        "eos_token_id": TINY_LLAMA_EOS_ID,
    }
    config_kwargs.update(config_overrides)
    model = _build(LlamaForCausalLM, LlamaConfig(**config_kwargs), seed)
    return _save(model, model_dir, tokenizer_vocab_size=TINY_LLAMA_VOCAB_SIZE)


TINY_QWEN3_LIKE: dict[str, Any] = {
    "vocab_size": TINY_LLAMA_VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": TINY_LLAMA_EOS_ID,
    "eos_token_id": TINY_LLAMA_EOS_ID,
}
TINY_FAMILIES: dict[str, dict[str, Any]] = {
    # head_dim 32 != hidden / heads (16): Qwen3 sets it explicitly
    "qwen3": {**TINY_QWEN3_LIKE, "intermediate_size": 128, "head_dim": 32},
    # 4 experts, top 2, renormalized; layer 1 is dense (mlp_only_layers) to cover the mixed stack
    "qwen3_moe": {
        **TINY_QWEN3_LIKE, "num_hidden_layers": 3, "head_dim": 32, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
    "mixtral": {**TINY_QWEN3_LIKE, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
    # a gated shared expert beside the routed ones; q/k/v bias; top-2 weights not renormalized (its default)
    "qwen2_moe": {
        **TINY_QWEN3_LIKE, "intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "num_experts": 4, "num_experts_per_tok": 2,
    },
}  # fmt: skip
"""Config of each tiny family (transformers' own config and model classes make and save them)."""


def make_tiny(family: str, model_dir: Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Save a tiny random ``family`` model (qwen3 | qwen3_moe | mixtral | qwen2_moe: 2-3 layers, hidden 64,
    vocab 1024, MoE with 4 experts top 2) plus the 1024-token tokenizer to ``model_dir``, built by transformers'
    classes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**TINY_FAMILIES[family], **config_overrides})
    model = _build(AutoModelForCausalLM.from_config, config, seed)
    return _save(model, model_dir, tokenizer_vocab_size=TINY_LLAMA_VOCAB_SIZE)


def make_tiny_gpt2(model_dir: Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Save a 3-layer GPT-2 (n_embd 64, real 50257-token vocab and tokenizer) to ``model_dir``."""
    config_kwargs: dict[str, Any] = {
        "vocab_size": GPT2_VOCAB_SIZE,
        "n_embd": 64,
        "n_layer": 3,
        "n_head": 4,
        "n_positions": 512,
    }
    config_kwargs.update(config_overrides)
    model = _build(GPT2LMHeadModel, GPT2Config(**config_kwargs), seed)
    return _save(model, model_dir, tokenizer_vocab_size=GPT2_VOCAB_SIZE)


def reinit_decisive(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Re-draw every parameter: matrices N(0, WEIGHT_STD), norm scales 1 + N(0, NORM_NOISE_STD),
    biases N(0, BIAS_STD). Iterates in ``named_parameters`` order, so the result depends only on the
    generator's seed (tied weights are drawn once)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("bias"):
                param.copy_(noise * BIAS_STD)
            elif param.ndim == 1:
                param.copy_(1.0 + noise * NORM_NOISE_STD)
            else:
                param.copy_(noise * WEIGHT_STD)


def _build(model_cls: Callable[[Any], PreTrainedModel], config: Any, seed: int) -> PreTrainedModel:
    # fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    reinit_decisive(model, torch.Generator().manual_seed(seed))
    return model.eval()


def _save(model: PreTrainedModel, model_dir: Path, tokenizer_vocab_size: int) -> Path:
    model_dir = Path(model_dir)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    write_gpt2_tokenizer(model_dir, vocab_size=tokenizer_vocab_size)
    return model_dir
