#!/usr/bin/env python3
"""Write a model folder for benchmarks: a named shape's config.json (run it with --load-format dummy) plus
GPT-2's tokenizer, which the router needs for text and detokenizing.

    python scripts/make_bench_model.py --shape llama-1b --out bench/models/llama-1b

NOTE: Llama and Qwen3 shapes keep their real vocabulary (128256 / 151936 rows); ids beyond the tokenizer's
50257 detokenize to empty text. Mixtral's 32000 rows are fewer than the tokenizer's ids: its eos is id 2 and
text prompts may tokenize to ids it refuses. Benchmarks send token ids and measure tokens, so only the streamed
text is affected.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pdserve.core.model_store import GPT2_VOCAB_SIZE, write_gpt2_tokenizer

EOS_ID = GPT2_VOCAB_SIZE - 1  # <|endoftext|>, valid in every shape below but mixtral-8x7b's
LLAMA: dict[str, Any] = dict(
    model_type="llama", max_position_embeddings=8192, rope_theta=500000.0, bos_token_id=EOS_ID, eos_token_id=EOS_ID
)
QWEN3: dict[str, Any] = dict(
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=EOS_ID, eos_token_id=EOS_ID,
)  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": dict(
        LLAMA, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
    ),
    "llama-8b": dict(
        LLAMA, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
    ),
    # Qwen/Qwen3-8B config.json: q/k head norms, head_dim 128 set explicitly, rope_theta 1e6, untied
    "qwen3-8b": dict(
        QWEN3, model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=12288,
    ),
    # Qwen/Qwen3-30B-A3B config.json: 128 experts of width 768, top 8 renormalized, every layer sparse
    "qwen3-30b-a3b": dict(
        QWEN3, model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    ),
    # mistralai/Mixtral-8x7B-v0.1 config.json: 8 experts of width 14336, top 2, rope_theta 1e6, rms eps 1e-5
    "mixtral-8x7b": dict(
        model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    ),
    "gpt2-124m": dict(
        model_type="gpt2", vocab_size=GPT2_VOCAB_SIZE, n_embd=768, n_layer=12, n_head=12, n_positions=1024,
    ),
}  # fmt: skip


def write_bench_model(shape: str, out: Path) -> Path:
    from transformers import AutoConfig

    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    write_gpt2_tokenizer(out)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    print(write_bench_model(args.shape, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
