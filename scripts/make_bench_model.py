#!/usr/bin/env python3
"""Write a model folder for benchmarks: a named shape's config.json (run it with --load-format dummy) plus
GPT-2's tokenizer, which the router needs for text and detokenizing.

    python scripts/make_bench_model.py --shape llama-1b --out bench/models/llama-1b

NOTE: Llama shapes keep their real vocabulary (128256 rows); ids beyond the tokenizer's 50257 detokenize
to empty text. Benchmarks send token ids and measure tokens, so only the streamed text is affected.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pdserve.core.model_store import GPT2_VOCAB_SIZE, write_gpt2_tokenizer

EOS_ID = GPT2_VOCAB_SIZE - 1  # <|endoftext|>, valid in every shape below
LLAMA: dict[str, Any] = dict(
    model_type="llama", max_position_embeddings=8192, rope_theta=500000.0, bos_token_id=EOS_ID, eos_token_id=EOS_ID
)
SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": dict(
        LLAMA, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
    ),
    "llama-8b": dict(
        LLAMA, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
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
