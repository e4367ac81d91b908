"""Runs StepPlans on the model: builds the flat token batch and attention metadata, returns logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from core.config import EngineConfig
from core.models import load_model
from core.scheduler import StepPlan
from kernels.attention import AttentionBackend, AttentionMetadata, TorchAttention


def kv_bytes_per_block(cfg: EngineConfig) -> int:
    m, dtype = cfg.model, cfg.cache.kv_dtype or cfg.model.dtype
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return 2 * m.num_layers * cfg.cache.block_size * m.num_kv_heads * m.head_dim * elem


def resolve_num_blocks(cfg: EngineConfig, device: torch.device) -> int:
    """Blocks the pool gets: CacheConfig.num_blocks, or a share of free memory after the weights."""
    if cfg.cache.num_blocks is not None:
        return cfg.cache.num_blocks
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.cache.memory_fraction)
    else:
        budget = int(cfg.cache.max_cpu_kv_bytes * cfg.cache.memory_fraction)
    return max(2, budget // kv_bytes_per_block(cfg))


KVAllocator = Callable[[int], torch.Tensor]
"""num_blocks -> the whole KV pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""


def kv_pool_shape(cfg: EngineConfig, num_blocks: int) -> tuple[int, ...]:
    m = cfg.model
    return (m.num_layers, 2, num_blocks, cfg.cache.block_size, m.num_kv_heads, m.head_dim)


class ModelRunner:
    """Owns the model weights and the KV cache tensors of one process.

    The KV pool is one contiguous tensor; a worker that shares it with another process (kvtransfer)
    passes kv_allocator to place it in shared memory.
    """

    def __init__(
        self, cfg: EngineConfig, backend: AttentionBackend | None = None, kv_allocator: KVAllocator | None = None
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.backend = backend or TorchAttention()
        self.model = load_model(cfg.model, self.backend, self.device)
        self.num_blocks = resolve_num_blocks(cfg, self.device)
        kv_dtype = getattr(torch, cfg.cache.kv_dtype or cfg.model.dtype)
        shape = kv_pool_shape(cfg, self.num_blocks)
        self.kv_pool = (
            kv_allocator(self.num_blocks) if kv_allocator else torch.zeros(shape, dtype=kv_dtype, device=self.device)
        )
        if tuple(self.kv_pool.shape) != shape:
            raise ValueError(f"KV pool shape {tuple(self.kv_pool.shape)} != expected {shape}")
        self.kv_caches = list(self.kv_pool.unbind(0))  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        self.num_forward_calls = 0
        self.num_forward_tokens = 0

    @torch.inference_mode()
    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """kv[:, dst] = kv[:, src] in every layer (one indexed copy per layer)."""
        src_t = torch.tensor(src, device=self.device)
        dst_t = torch.tensor(dst, device=self.device)
        self.kv_pool[:, :, dst_t] = self.kv_pool[:, :, src_t]

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run plan.chunks through the model; [num_sampling_chunks, vocab] float32 logits, in chunk order."""
        if plan.copies:
            self.copy_blocks([c.src for c in plan.copies], [c.dst for c in plan.copies])
        input_ids, positions, meta, logits_idx = self._prepare(plan)
        self.backend.prepare(meta)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden]
        self.num_forward_calls += 1
        self.num_forward_tokens += input_ids.numel()
        return self.model.compute_logits(hidden[logits_idx])  # type: ignore[operator]

    def _prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.cfg.cache.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_lens, seq_lens, logits_idx = [], [], []
        max_blocks = max(len(c.req.block_ids) for c in plan.chunks)
        tables = torch.zeros(len(plan.chunks), max_blocks, dtype=torch.int32)
        for i, chunk in enumerate(plan.chunks):
            req, start = chunk.req, chunk.req.num_computed_tokens
            end = start + chunk.num_tokens
            ids.extend(req.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(req.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            q_lens.append(chunk.num_tokens)
            seq_lens.append(end)
            tables[i, : len(req.block_ids)] = torch.tensor(req.block_ids, dtype=torch.int32)
            if chunk.samples:
                logits_idx.append(len(ids) - 1)
        dev = self.device
        q_start = [0]
        for n in q_lens:
            q_start.append(q_start[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(q_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            query_lens=q_lens,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        return input_ids, positions, meta, torch.tensor(logits_idx, dtype=torch.int64, device=dev)
