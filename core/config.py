"""Frozen configuration: the model, the KV cache, the scheduler, and the engine that bundles them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from pdserve.core.parallel import ParallelConfig, kv_head_range

Arch = Literal["llama", "gpt2", "qwen3_moe", "mixtral"]
LoadFormat = Literal["auto", "dummy"]

_LLAMA_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
_MOE_TYPES: dict[str, Arch] = {"qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen3_moe", "mixtral": "mixtral"}
"""Model types built from the llama blocks with a sparse MoE feed-forward (core/models/moe.py)."""
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


KVPoolShape = tuple[int, int, int, int, int, int]


def kv_pool_shape(num_layers: int, num_blocks: int, block_size: int, num_heads: int, head_dim: int) -> KVPoolShape:
    """One rank's KV pool, a single tensor [num_layers, 2, num_blocks, block_size, num_heads, head_dim]: index 0 of
    dim 1 is K, 1 is V; num_heads are the rank's KV heads (core.parallel.kv_head_range)."""
    return (num_layers, 2, num_blocks, block_size, num_heads, head_dim)


def torch_dtype(name: str) -> torch.dtype:
    """'float32' | 'float16' | 'bfloat16' -> torch dtype."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, read from a checkpoint's config.json (core/hf_config.py)."""

    path: str
    """Folder with config.json (+ safetensors unless load_format is dummy)."""
    name: str
    """Name reported to clients and used in the layout fingerprint."""
    arch: Arch
    """Model family implemented in core/models."""
    vocab_size: int
    """Rows of the embedding table; valid token ids are [0, vocab_size)."""
    hidden_size: int
    """Residual stream width."""
    num_layers: int
    """Transformer blocks."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA when fewer than num_heads)."""
    head_dim: int
    """Width of one attention head."""
    intermediate_size: int
    """MLP width (Mixtral: each expert's; Qwen3-MoE: the dense layers', its experts' is moe_intermediate_size)."""
    max_model_len: int
    """Longest sequence (prompt + output) the model accepts."""
    eos_token_ids: tuple[int, ...]
    """Tokens that end generation unless ignore_eos."""
    dtype: str = "float32"
    """Weights and activations: float32 | float16 | bfloat16."""
    load_format: LoadFormat = "auto"
    """auto reads safetensors; dummy fills seeded random weights (benchmarks of large shapes)."""
    seed: int = 0
    """Seed of dummy weights."""
    hf_config: Any = field(default=None, compare=False, repr=False)
    """The transformers config object, for family-specific fields (norm eps, rope, biases)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: str = "float32", load_format: LoadFormat = "auto", seed: int = 0
    ) -> ModelConfig:
        """Read config.json (and generation_config.json for eos ids) from a model folder."""
        from pdserve.core.hf_config import load_hf_config

        hf = load_hf_config(path)
        return cls.from_hf_config(hf, str(path), dtype=dtype, load_format=load_format, seed=seed)

    @classmethod
    def from_hf_config(
        cls, hf: Any, path: str, dtype: str = "float32", load_format: LoadFormat = "auto", seed: int = 0
    ) -> ModelConfig:
        """Map a transformers config onto ModelConfig; refuse families core/models does not implement."""
        torch_dtype(dtype)
        if hf.model_type in _LLAMA_TYPES or hf.model_type in _MOE_TYPES:
            arch: Arch = _MOE_TYPES.get(hf.model_type, "llama")
            num_heads, hidden = hf.num_attention_heads, hf.hidden_size
            shape = dict(
                hidden_size=hidden,
                num_layers=hf.num_hidden_layers,
                num_heads=num_heads,
                num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
                head_dim=getattr(hf, "head_dim", None) or hidden // num_heads,
                intermediate_size=hf.intermediate_size,
                max_model_len=min(hf.max_position_embeddings, sliding_window(hf) or hf.max_position_embeddings),
            )
        elif hf.model_type == "gpt2":
            arch = "gpt2"
            shape = dict(
                hidden_size=hf.n_embd,
                num_layers=hf.n_layer,
                num_heads=hf.n_head,
                num_kv_heads=hf.n_head,
                head_dim=hf.n_embd // hf.n_head,
                intermediate_size=hf.n_inner or 4 * hf.n_embd,
                max_model_len=hf.n_positions,
            )
        else:
            supported = "llama family, qwen3_moe, qwen2_moe, mixtral or gpt2"
            raise ValueError(f"model type {hf.model_type!r} is not supported ({supported})")
        name = Path(path).name or str(getattr(hf, "name_or_path", "model"))
        return cls(
            path=str(path),
            name=name,
            arch=arch,
            vocab_size=hf.vocab_size,
            eos_token_ids=_eos_ids(hf, path),
            dtype=dtype,
            load_format=load_format,
            seed=seed,
            hf_config=hf,
            **shape,
        )


def sliding_window(hf: Any) -> int | None:
    """The attention window a config turns on (Mistral's and Mixtral's sliding_window; Qwen2's and Qwen3's when
    use_sliding_window), or None. The engine attends to the whole context, which equals windowed attention only
    while no sequence is longer than the window: the model's context is capped to it (as vLLM did before it had
    sliding windows)."""
    window = getattr(hf, "sliding_window", None)
    if not window or (hasattr(hf, "use_sliding_window") and not hf.use_sliding_window):
        return None
    return int(window)


def _eos_ids(hf: Any, path: str) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (it may list several), else config.json."""
    eos: Any = None
    try:
        generation = json.loads((Path(path) / "generation_config.json").read_text())
        eos = generation.get("eos_token_id") if isinstance(generation, dict) else None
    except (OSError, ValueError):
        eos = None
    if eos is None:
        eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int | None = None
    """Blocks in the pool (block 0 is the null block); None sizes it from memory_fraction."""
    memory_fraction: float = 0.5
    """Share of free device memory (CUDA) or of max_cpu_kv_bytes (CPU) the pool takes when num_blocks is None."""
    max_cpu_kv_bytes: int = 2 << 30
    """Upper bound of the pool's bytes on CPU, where free memory is not measured."""
    kv_dtype: str | None = None
    """KV dtype; None follows the model dtype."""
    enable_prefix_caching: bool = True
    """Reuse cached full blocks and whole-prompt logits across requests."""
    max_cached_logits: int = 256
    """Whole-prompt last_logits entries kept on the device (each is one vocab-sized row)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits of one engine step."""

    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 4096
    """Most tokens in one forward pass (prefill chunks + one per decoding request)."""
    prefill_chunk_size: int | None = None
    """Split prompts into chunks of at most this many tokens; None prefills whole prompts."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything one in-process engine needs."""

    model: ModelConfig
    """The model."""
    cache: CacheConfig = CacheConfig()
    """The KV cache."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """Batching limits."""
    device: str = "cpu"
    """cpu | cuda | cuda:N."""
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    """auto: the Triton kernels on CUDA, the torch reference elsewhere."""
    enforce_eager: bool = False
    """Run every pass eagerly; otherwise (CUDA, Triton backend) decode passes and prefill passes of up to
    max_num_batched_tokens tokens (and the largest of core.prefill_graphs.PREFILL_GRAPH_TOKENS) replay captured
    CUDA graphs (core/cuda_graphs.py, core/prefill_graphs.py)."""
    capture_decode: bool = True
    """Capture decode graphs (a prefill worker, which hands requests off after their first token, needs none)."""
    parallel: ParallelConfig = ParallelConfig()
    """This process's rank in its worker's TP group (core/parallel.py)."""

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads in this rank's pool: its share of the model's, or one replicated head."""
        p = self.parallel
        return kv_head_range(self.model.num_kv_heads, p.tp_size, p.tp_rank)[1]
