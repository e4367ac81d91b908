"""Runs StepPlans on the model: builds the flat token batch and attention metadata, returns logits."""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from pdserve.core.config import EngineConfig, KVPoolShape, kv_pool_shape
from pdserve.core.cuda_graphs import DecodeGraphs, graph_batch_sizes
from pdserve.core.decode_batch import DecodeBatch
from pdserve.core.messages import RankDecodeCmd, RankPassCmd
from pdserve.core.models import interleave_mlp_weights, load_model
from pdserve.core.parallel import tp_group
from pdserve.core.prefill_graphs import PrefillGraphs
from pdserve.core.prefill_staging import PREFILL_GRAPH_SEQS, HostInputs
from pdserve.core.rank_pass import copies_of, decode_cmd, host_inputs, pass_cmd, stage_decode
from pdserve.core.request import Request
from pdserve.core.sampler import SamplingState
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.scheduler import ScheduledChunk, StepPlan
from pdserve.kernels.attention import (
    AttentionBackend,
    AttentionMetadata,
    MixedSplit,
    OutputRows,
    TorchAttention,
    num_leading_decodes,
)
from pdserve.kernels.pass_inputs import token_positions_slots
from pdserve.kernels.split_policy import SPLIT_MAX_TOKENS, SPLIT_MIN_PREFIX

WARMUP_LENGTHS = (1, 7, 16, 31, 64, 200)
"""Prompt lengths of the warm-up passes: each prefill-attention tile height (it follows the longest query)."""
WARMUP_BATCHES = (1, PREFILL_GRAPH_SEQS + 1)
"""Prompts per warm-up pass: one (a prefill graph's pass) and more than a graph takes (an eager pass)."""


def kv_bytes_per_block(cfg: EngineConfig) -> int:
    elem = getattr(torch, cfg.cache.kv_dtype or cfg.model.dtype).itemsize
    return math.prod(_pool_shape(cfg, 1)) * elem


def resolve_num_blocks(cfg: EngineConfig, device: torch.device) -> int:
    """Blocks the pool gets: CacheConfig.num_blocks, or a share of free memory after the weights."""
    if cfg.cache.num_blocks is not None:
        return cfg.cache.num_blocks
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.cache.memory_fraction)
    else:
        budget = int(cfg.cache.max_cpu_kv_bytes * cfg.cache.memory_fraction)
    num_blocks = torch.tensor([max(2, budget // kv_bytes_per_block(cfg))], device=device)
    # NOTE: one block table serves every rank of a TP group: each rank's pool gets the fewest any rank fits
    return int(tp_group().all_reduce(num_blocks, dist.ReduceOp.MIN).item())


KVAllocator = Callable[[int], torch.Tensor]
"""num_blocks -> the whole KV pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""


def _pool_shape(cfg: EngineConfig, num_blocks: int) -> KVPoolShape:
    m = cfg.model
    return kv_pool_shape(m.num_layers, num_blocks, cfg.cache.block_size, cfg.kv_heads_per_rank, m.head_dim)


def make_backend(cfg: EngineConfig, device: torch.device) -> AttentionBackend:
    """The attention backend a config names; auto picks Triton on CUDA."""
    name = cfg.attention_backend
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from pdserve.kernels.triton_backend import TritonAttention

        # NOTE: a graphed prefill pass attends its logits rows (decode slots + chunk slots) as a decode batch
        return TritonAttention(max_batch=cfg.scheduler.max_num_seqs + PREFILL_GRAPH_SEQS)
    return TorchAttention()


def _token_ids(chunks: list[ScheduledChunk], starts: list[int], ends: list[int], num_tokens: int) -> np.ndarray:
    """[num_tokens] int64 ids of the chunks' tokens, in order: slices of the requests' token arrays when they hold
    every chunk (prefill passes), else one fromiter over the chained list slices (128 one-token chunks: 3x a
    concatenate converting each)."""
    arrays = [c.req.token_array for c in chunks]
    if all(end <= len(a) for a, end in zip(arrays, ends, strict=True)):
        if len(chunks) == 1:
            return arrays[0][starts[0] : ends[0]]
        return np.concatenate([a[s:e] for a, s, e in zip(arrays, starts, ends, strict=True)])
    slices = (c.req.token_ids[s:e] for c, s, e in zip(chunks, starts, ends, strict=True))
    return np.fromiter(itertools.chain.from_iterable(slices), np.int64, num_tokens)


def _block_tables(block_ids: list[list[int]]) -> np.ndarray:  # [num_seqs, longest] int32, padded with 0
    if len(block_ids) == 1:
        return np.array(block_ids, dtype=np.int32)
    tables = np.zeros((len(block_ids), max(map(len, block_ids))), dtype=np.int32)
    for row, ids in zip(tables, block_ids, strict=True):
        row[: len(ids)] = ids
    return tables


class DevicePass(NamedTuple):
    """An eager pass's inputs on the device."""

    ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata


def _packed(parts: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """The parts (one dtype) in one array, each starting at a 16-byte boundary; and where each starts."""
    step = 16 // parts[0].dtype.itemsize
    offsets = np.cumsum([0] + [-(-len(p) // step) * step for p in parts])
    out = np.zeros(int(offsets[-1]), dtype=parts[0].dtype)
    for part, at in zip(parts, offsets, strict=False):
        out[at : at + len(part)] = part
    return out, [int(at) for at in offsets[:-1]]


def is_decode_pass(chunks: list[ScheduledChunk]) -> bool:
    """Every chunk is one token that samples: the pass can run on the persistent decode inputs."""
    return all(c.num_tokens == 1 and c.samples for c in chunks)


class StartupPhase:
    """`with phase("weights"):` adds the seconds the block took (the device's work included) to phases[name]."""

    def __init__(self, phases: dict[str, float], device: torch.device) -> None:
        self.phases, self.device = phases, device

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start


class ModelRunner:
    """Owns the model weights and the KV cache tensors of one process.

    The KV pool is one contiguous tensor; a worker that shares it with another process (kvtransfer)
    passes kv_allocator to place it in shared memory.
    """

    def __init__(
        self, cfg: EngineConfig, backend: AttentionBackend | None = None, kv_allocator: KVAllocator | None = None
    ) -> None:
        if tp_group().size != cfg.parallel.tp_size:
            raise ValueError(f"TP size {cfg.parallel.tp_size}, but this process's group has {tp_group().size} ranks")
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.startup_s: dict[str, float] = {}
        """Seconds each start-up phase took ("weights", "KV pool", "decode graphs", "prefill graphs", "warm-up")."""
        self._phase = phase = StartupPhase(self.startup_s, self.device)
        self.backend = backend or make_backend(cfg, self.device)
        with phase("weights"):
            self.model = load_model(cfg.model, self.backend, self.device)
            if self._uses_triton():
                interleave_mlp_weights(self.model)
        self.symmetric_all_reduce = tp_group().use_symmetric_memory(
            cfg.parallel.all_reduce, cfg.scheduler.max_num_seqs, cfg.model.hidden_size, getattr(torch, cfg.model.dtype),
            self.device,
        )  # fmt: skip
        """Decode-sized all-reduces read the peers' symmetric buffers (core/parallel.py), on every rank alike."""
        self.num_blocks = resolve_num_blocks(cfg, self.device)
        kv_dtype = getattr(torch, cfg.cache.kv_dtype or cfg.model.dtype)
        shape = _pool_shape(cfg, self.num_blocks)
        with phase("KV pool"):
            self.kv_pool = (
                kv_allocator(self.num_blocks)
                if kv_allocator
                else torch.zeros(shape, dtype=kv_dtype, device=self.device)
            )
        if tuple(self.kv_pool.shape) != shape:
            raise ValueError(f"KV pool shape {tuple(self.kv_pool.shape)} != expected {shape}")
        self.kv_caches = list(self.kv_pool.unbind(0))  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        self.num_forward_calls = 0
        self.num_forward_tokens = 0
        max_blocks = -(-cfg.model.max_model_len // cfg.cache.block_size)
        self.decode_batch = DecodeBatch(cfg.scheduler.max_num_seqs, max_blocks, cfg.cache.block_size, self.device)
        with phase("decode graphs"):
            self.graphs = self._capture_graphs() if self._uses_graphs() and cfg.capture_decode else None
        with phase("prefill graphs"):
            self.prefill_graphs = self._capture_prefill_graphs(max_blocks) if self._uses_graphs() else None
        self.fanout: Callable[[RankPassCmd | RankDecodeCmd], None] | None = None
        """Rank 0 of a TP group (core/rank_group.py): sends each pass to the other ranks before running it."""

    def lead(self, fanout: Callable[[RankPassCmd | RankDecodeCmd], None]) -> None:
        """Rank 0 of a TP group, once the other ranks are as warmed up as we are: fanout(cmd) takes every pass
        to them from now on (their decode batches then follow ours row for row)."""
        self.decode_batch.record_tables()
        self.fanout = fanout

    def _uses_triton(self) -> bool:
        if self.device.type != "cuda":
            return False
        from pdserve.kernels.triton_backend import TritonAttention  # triton is only needed on CUDA

        return isinstance(self.backend, TritonAttention)

    def _uses_graphs(self) -> bool:
        # NOTE: a model whose forward reads device values on the host (MoE experts on the torch loop) says so
        return self._uses_triton() and not self.cfg.enforce_eager and getattr(self.model, "capturable", True)

    def _capture_graphs(self) -> DecodeGraphs:
        sizes = graph_batch_sizes(self.cfg.scheduler.max_num_seqs)
        graphs = DecodeGraphs(self._decode_forward, self.decode_batch, self.backend, sizes)
        graphs.capture()
        return graphs

    def _capture_prefill_graphs(self, max_blocks: int) -> PrefillGraphs:
        max_tokens = self.cfg.scheduler.max_num_batched_tokens
        block_size = self.cfg.cache.block_size
        decode_slots = self.cfg.scheduler.max_num_seqs if self.cfg.capture_decode else 0  # a decode worker's
        graphs = PrefillGraphs(
            self._prefill_forward, self.backend, max_tokens, max_blocks, block_size, self.device, decode_slots
        )
        graphs.capture()
        return graphs

    def _prefill_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_rows, vocab] float32: the logits of meta.rows
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [num_rows, hidden]
        return self.model.compute_logits(hidden)  # type: ignore[operator]

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: object) -> torch.Tensor:
        assert isinstance(meta, AttentionMetadata)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [batch, hidden]
        return self.model.compute_logits(hidden)  # type: ignore[operator]

    @torch.inference_mode()
    def warmup(self, lengths: tuple[int, ...] = WARMUP_LENGTHS) -> None:
        """Compile the Triton kernels of prefill passes before serving: passes of each prompt length, graphed
        and eager, on the null block 0 (whose contents nothing reads). Without it requests pay the JIT: 0.3-1 s
        per kernel variant, during which every stream of the worker stalls (kernels/jit_watch.py counts the
        variants compiled after the warm-up).
        """
        with self._phase("warm-up"):
            self._warmup(lengths)

    def _warmup(self, lengths: tuple[int, ...]) -> None:
        bs, max_len = self.cfg.cache.block_size, self.cfg.model.max_model_len - 1

        def chunk(n: int, prefix: int = 0) -> ScheduledChunk:
            req = Request("warmup", [0] * (prefix + n), prefix + n, SamplingState(SamplingParams(), ()))
            req.block_ids.extend([0] * -(-(prefix + n) // bs))
            req.num_computed_tokens = prefix
            return ScheduledChunk(req, n)

        for n in sorted({min(n, max_len) for n in lengths}):
            for num_seqs in WARMUP_BATCHES:
                self.execute(StepPlan(chunks=[chunk(n) for _ in range(num_seqs)]))
            if n <= SPLIT_MAX_TOKENS and SPLIT_MIN_PREFIX + n <= max_len:  # a split pass (kernels/prefill_splits.py)
                self.execute(StepPlan(chunks=[chunk(n, SPLIT_MIN_PREFIX)]))
        # an eager pass led by a decode (kernels/attention.py MixedSplit: the decode kernel on q rotated already)
        self.execute(StepPlan(chunks=[chunk(1, 1)] + [chunk(16) for _ in range(PREFILL_GRAPH_SEQS + 1)]))
        self.num_forward_calls = self.num_forward_tokens = 0

    @torch.inference_mode()
    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """kv[:, dst] = kv[:, src] in every layer (one indexed copy per layer)."""
        src_t = torch.tensor(src, device=self.device)
        dst_t = torch.tensor(dst, device=self.device)
        self.kv_pool[:, :, dst_t] = self.kv_pool[:, :, src_t]

    @torch.inference_mode()
    def execute(self, plan: StepPlan, sampled_rows: Sequence[int] | None = None) -> torch.Tensor:
        """Run plan.chunks through the model; [num_sampling_chunks, vocab] float32 logits, in chunk order.

        sampled_rows (decode passes only): see DecodeBatch.load; the engine's in-flight tokens.
        Rank 0 of a TP group sends the pass to the other ranks (fanout) before it runs it.
        """
        copies = copies_of([c.src for c in plan.copies], [c.dst for c in plan.copies])
        if copies:
            self.copy_blocks(*copies)
        self.num_forward_calls += 1
        self.num_forward_tokens += plan.num_tokens
        if is_decode_pass(plan.chunks):
            reqs = [c.req for c in plan.chunks]
            n, padded = len(reqs), self._padded(len(reqs))
            seq_lens = self.decode_batch.stage(reqs, padded, sampled_rows)
            if self.fanout is not None:
                self.fanout(decode_cmd(self.decode_batch, n, padded, sampled_rows is not None, copies))
            return self._run_decode(n, padded, seq_lens, sampled_rows is not None)
        assert sampled_rows is None, "only a decode pass takes tokens that are still on the device"
        host = self._host_inputs(plan)
        if self.fanout is not None:
            self.fanout(pass_cmd(host, copies))
        return self._run_pass(host)

    @torch.inference_mode()
    def replay(self, cmd: RankPassCmd | RankDecodeCmd) -> None:
        """Run the pass rank 0 of our TP group sent (a rank > 0); its logits are rank 0's business."""
        if cmd.copies:
            self.copy_blocks(*cmd.copies)
        if isinstance(cmd, RankDecodeCmd):
            seq_lens = stage_decode(self.decode_batch, cmd)
            self._run_decode(cmd.num_seqs, len(cmd.seq_lens) // 4, seq_lens, cmd.gathers)
        else:
            self._run_pass(host_inputs(cmd))

    def _run_pass(self, host: HostInputs) -> torch.Tensor:  # [num_sampling, vocab] float32
        graphs = self.prefill_graphs
        if graphs is not None and (num_decodes := graphs.decodes_if_fits(host)) is not None:
            return graphs.run(host, num_decodes)
        dev = self._to_device(host)
        self.backend.prepare(dev.meta)
        return self._prefill_forward(dev.ids, dev.positions, dev.meta)

    def _padded(self, n: int) -> int:
        """Rows of a decode pass of n: the graph's batch size that holds it, else n."""
        graphs = self.graphs
        return graphs.padded_size(n) if graphs is not None and n <= graphs.max_size else n

    def _run_decode(self, n: int, padded: int, seq_lens: list[int], gathers: bool) -> torch.Tensor:  # [n, vocab]
        """A decode pass on the persistent inputs (staged): a CUDA graph replay when one holds the batch."""
        batch = self.decode_batch
        batch.upload(n, padded, gathers)
        if self.graphs is not None and n <= self.graphs.max_size:
            return self.graphs.replay(n)
        meta = batch.metadata(n, seq_lens)
        self.backend.prepare(meta)
        return self._decode_forward(batch.input_ids[:n], batch.positions[:n], meta)

    def _host_inputs(self, plan: StepPlan) -> HostInputs:
        """A general pass's token ids and per-sequence metadata, built with numpy on the host (positions and
        slots follow from them: kernels/pass_inputs.py).

        NOTE: on the critical path of every prefill; built from Python lists with one array each (a 4000-token
        prompt, CPU VM: 17.8 -> 9.5 us; the device tool's hosts run this code 6-10x slower)."""
        chunks = plan.chunks
        q_lens = [c.num_tokens for c in chunks]
        starts = [c.req.num_computed_tokens for c in chunks]
        seq_lens = list(map(operator.add, starts, q_lens))
        ends = list(itertools.accumulate(q_lens))
        tables = _block_tables([c.req.block_ids for c in chunks])
        ids = _token_ids(chunks, starts, seq_lens, ends[-1])
        rows = [i for i, c in enumerate(chunks) if c.samples]
        logits_idx = np.array([ends[i] - 1 for i in rows], dtype=np.int64)
        query_start = np.array([0, *ends], dtype=np.int32)
        row_seqs = np.array(rows, dtype=np.int64)
        return HostInputs(ids, logits_idx, query_start, np.array(seq_lens, np.int32), tables, row_seqs)

    def _to_device(self, host: HostInputs) -> DevicePass:
        """An eager pass's ids, positions and metadata (its logits rows' too) on the device, in two copies.

        NOTE: every part starts 16 bytes aligned and block tables are a multiple of 16 columns wide: Triton
        specializes a kernel on its pointers' alignment and on integers divisible by 16, so parts at offsets and
        widths that vary from pass to pass compiled new kernel variants while serving (an H200 colocated burst
        stalled 11 times for 0.4-1.3 s). One variant per kernel now, compiled by the warm-up.
        """
        n, rows = len(host.ids), host.row_seqs
        bs = self.cfg.cache.block_size
        positions, slots_np = token_positions_slots(host.query_start, host.seq_lens, host.tables, bs)
        longs_np, (ids_at, pos_at, slots_at, rows_at) = _packed([host.ids, positions, slots_np, host.logits_idx])
        longs = torch.from_numpy(longs_np).to(self.device, non_blocking=True)
        width = -(-host.tables.shape[1] // 16) * 16
        tables = np.zeros((len(host.seq_lens), width), dtype=np.int32)
        tables[:, : host.tables.shape[1]] = host.tables
        row_seq_lens, row_tables = host.seq_lens[rows], tables[rows]
        row_starts = np.arange(len(rows) + 1, dtype=np.int32)
        query_lens = np.diff(host.query_start).tolist()
        d = num_leading_decodes(query_lens)
        parts = [host.query_start, host.seq_lens, tables.ravel(), row_starts, row_seq_lens, row_tables.ravel()]
        parts += [host.query_start[d:], host.seq_lens[d:]] if d else []  # NOTE: the chunks' own, 16-byte aligned
        ints_np, offsets = _packed(parts)
        ints = torch.from_numpy(ints_np).to(self.device, non_blocking=True)
        q_start, lens, tables_dev, row_start, row_lens, row_tables_dev, *chunk_parts = (
            ints[at : at + len(part)] for part, at in zip(parts, offsets, strict=True)
        )
        tables_dev = tables_dev.view(-1, width)
        slots = longs[slots_at : slots_at + n]
        meta = self._meta(q_start, lens, tables_dev, query_lens, host.seq_lens, slots)
        row_meta = self._meta(row_start, row_lens, row_tables_dev.view(-1, width), [1] * len(rows), row_seq_lens, None)
        meta.rows = OutputRows(longs[rows_at : rows_at + len(rows)], row_meta)
        if d:
            decodes = self._meta(q_start[: d + 1], lens[:d], tables_dev[:d], [1] * d, host.seq_lens[:d], None)
            chunk_starts, chunk_lens = chunk_parts
            chunks = self._meta(chunk_starts, chunk_lens, tables_dev[d:], query_lens[d:], host.seq_lens[d:], None)
            meta.mixed = MixedSplit(decodes, chunks)
        return DevicePass(longs[ids_at : ids_at + n], longs[pos_at : pos_at + n], meta)

    def _meta(
        self,
        query_start: torch.Tensor,
        seq_lens: torch.Tensor,
        tables: torch.Tensor,  # [num_seqs, num_table_blocks]
        query_lens: list[int],
        seq_lens_cpu: np.ndarray,
        slots: torch.Tensor | None,
    ) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=query_start,
            seq_lens=seq_lens,
            block_tables=tables,
            query_lens=query_lens,
            seq_lens_cpu=seq_lens_cpu.tolist(),
            block_size=self.cfg.cache.block_size,
        )
