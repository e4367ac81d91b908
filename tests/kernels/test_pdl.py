"""Programmatic dependent launch of the one-row decode chain's kernels: each starts while the kernel before it
finishes and waits on it before it writes anything or reads what that kernel may have written. A decode step of
these kernels captured in a CUDA graph gives, replay after replay with new inputs, the bits the same step gives
without PDL (a kernel that read an input before its wait would see the previous replay's, one that wrote before
it could clobber what the kernel before still reads). GPU tests on sm_90+; the PTX of each kernel's PDL variant
is checked on CPU in tests/kernels/test_sm90_compile.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import pytest
import torch
from torch import Tensor

from pdserve.kernels.triton_utils import use_pdl

if TYPE_CHECKING:
    from pdserve.kernels.decode_attention import DecodeWorkspace
    from pdserve.kernels.rope_tiles import RopeTables

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, HALF = 1024, 16, 4, 64, 2048, 128
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS, NUM_LAYERS, EPS = 16, 160, 128, 2, 1e-6
"""MAX_BLOCKS * BLOCK_SIZE = 2048 tokens of context: the decode attention splits (stage 2 runs)."""
NUM_REPLAYS = 6


class Layer(NamedTuple):
    norm: Tensor  # [HIDDEN]
    qkv: Tensor  # [(HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN]
    o: Tensor  # [HIDDEN, HEADS * HEAD_DIM]
    post_norm: Tensor  # [HIDDEN]
    gate_up: Tensor  # [2 * INTER, HIDDEN], gate/up interleaved in blocks of HALF rows
    down: Tensor  # [HIDDEN, INTER]
    cache: Tensor  # [2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM]


class SoloSum(NamedTuple):
    """kernels/allreduce_norm.py's fused sum over a TP group of one rank (its protocol state, no peers)."""

    buffer: Tensor  # [SLOTS, 1, 1, HIDDEN]
    buffer_ptrs: Tensor  # [1] int64
    slot_rows: Tensor  # [SLOTS] int32
    epochs: Tensor  # [PROGRAMS] int32


class Step(NamedTuple):
    """A decode step's inputs, static buffers a replay reads."""

    hidden: Tensor  # [1, HIDDEN]
    position: Tensor  # [1] int64
    seq_len: Tensor  # [1] int32
    block_table: Tensor  # [1, MAX_BLOCKS] int32


def randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)


def make_layer(gen: torch.Generator) -> Layer:
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return Layer(
        1 + randn(HIDDEN, gen=gen, scale=0.1), randn(qkv_rows, HIDDEN, gen=gen, scale=HIDDEN**-0.5),
        randn(HIDDEN, HEADS * HEAD_DIM, gen=gen, scale=(HEADS * HEAD_DIM) ** -0.5),
        1 + randn(HIDDEN, gen=gen, scale=0.1), randn(2 * INTER, HIDDEN, gen=gen, scale=HIDDEN**-0.5),
        randn(HIDDEN, INTER, gen=gen, scale=INTER**-0.5),
        randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, gen=gen),
    )  # fmt: skip


def solo_sum() -> SoloSum:
    from pdserve.kernels.allreduce_norm import PROGRAMS, SLOTS, fill_sentinel

    buffer = torch.empty(SLOTS, 1, 1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    fill_sentinel(buffer)
    ptrs = torch.tensor([buffer.data_ptr()], dtype=torch.int64, device="cuda")
    slot_rows = torch.zeros(SLOTS, dtype=torch.int32, device="cuda")
    return SoloSum(buffer, ptrs, slot_rows, torch.ones(PROGRAMS, dtype=torch.int32, device="cuda"))


def rope_tables() -> RopeTables:  # cos, sin: [MAX_BLOCKS * BLOCK_SIZE, HEAD_DIM] fp32
    from pdserve.kernels.rope_tiles import RopeTables

    inv_freq = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2, device="cuda") / HEAD_DIM)
    freqs = torch.outer(torch.arange(MAX_BLOCKS * BLOCK_SIZE, device="cuda", dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), -1)
    return RopeTables(emb.cos(), emb.sin())


def decode_step(
    layers: list[Layer], rope: RopeTables, fused: SoloSum, step: Step, workspace: DecodeWorkspace, pdl: bool
) -> Tensor:  # [1, HIDDEN]
    """A Llama decode step at one row, every kernel launched with or without PDL."""
    from pdserve.kernels.allreduce_norm import PeerRows, all_reduce_rms_norm
    from pdserve.kernels.decode_attention import paged_decode_attention
    from pdserve.kernels.fused_ops import rms_norm_triton
    from pdserve.kernels.gemv import gemv
    from pdserve.kernels.kv_append import append_kv

    push, kv = PeerRows(fused.buffer_ptrs, fused.epochs, 1, 0), KV_HEADS * HEAD_DIM
    h, residual = step.hidden, None
    for layer in layers:
        if residual is None:
            x, residual = rms_norm_triton(h, layer.norm, EPS, pdl=pdl), h
        else:
            x, residual = rms_norm_triton(h, layer.norm, EPS, residual, pdl=pdl)
        q, k, v = (t.view(1, -1, HEAD_DIM) for t in gemv(x, layer.qkv, pdl=pdl).split([HEADS * HEAD_DIM, kv, kv], -1))
        append_kv(k, v, layer.cache, positions=step.position, block_tables=step.block_table, rope=rope, pdl=pdl)
        attn = paged_decode_attention(
            q, layer.cache, step.block_table, step.seq_len, HEAD_DIM**-0.5, workspace=workspace, rope=rope, pdl=pdl
        )
        o = gemv(attn.view(1, -1), layer.o, push=push, pdl=pdl)
        x, residual = all_reduce_rms_norm(
            o, residual, layer.post_norm, EPS, fused.buffer_ptrs, fused.slot_rows, fused.epochs, 1, 0, True, pdl
        )
        h = gemv(gemv(x, layer.gate_up, pdl=pdl), layer.down, HALF, pdl=pdl)
    assert residual is not None
    return rms_norm_triton(h, layers[0].norm, EPS, residual, pdl=pdl)[0]


def new_inputs(step: Step, gen: torch.Generator) -> None:
    """A new row and a new context length (1 to the table's 2048 tokens) into the step's buffers."""
    seq_len = int(torch.randint(1, MAX_BLOCKS * BLOCK_SIZE + 1, (1,), generator=gen, device="cuda").item())
    step.hidden.copy_(randn(1, HIDDEN, gen=gen))
    step.position.fill_(seq_len - 1)
    step.seq_len.fill_(seq_len)


def replay_outputs(layers: list[Layer], caches: list[Tensor], step: Step, pdl: bool) -> list[Tensor]:
    """Each replay's output and, last, every layer's cache: a CUDA graph of decode_step, its inputs new each
    replay (the same for pdl on and off), the caches reset to `caches` first."""
    from pdserve.kernels.decode_attention import MAX_SPLITS, DecodeWorkspace

    workspace = DecodeWorkspace.allocate(1, HEADS, HEAD_DIM, MAX_SPLITS, "cuda")
    rope, fused = rope_tables(), solo_sum()
    decode_step(layers, rope, fused, step, workspace, pdl)  # NOTE: compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_step(layers, rope, fused, step, workspace, pdl)
    for layer, cache in zip(layers, caches, strict=True):
        layer.cache.copy_(cache)
    gen, outputs = torch.Generator(device="cuda").manual_seed(1), []
    for _ in range(NUM_REPLAYS):
        new_inputs(step, gen)
        graph.replay()
        outputs.append(out.clone())
    torch.cuda.synchronize()
    return outputs + [layer.cache.clone() for layer in layers]


@pytest.mark.gpu
def test_a_decode_step_with_pdl_in_a_cuda_graph_gives_the_bits_it_gives_without() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [make_layer(gen) for _ in range(NUM_LAYERS)]
    caches = [layer.cache.clone() for layer in layers]
    blocks = torch.randperm(NUM_BLOCKS - 1, generator=gen, device="cuda")[:MAX_BLOCKS] + 1
    position = torch.zeros(1, dtype=torch.int64, device="cuda")
    seq_len = torch.ones(1, dtype=torch.int32, device="cuda")
    step = Step(randn(1, HIDDEN, gen=gen), position, seq_len, blocks.to(torch.int32).view(1, MAX_BLOCKS))
    plain = replay_outputs(layers, caches, step, pdl=False)
    early = replay_outputs(layers, caches, step, pdl=True)
    assert all(t.isfinite().all() for t in plain)
    assert not torch.equal(plain[0], plain[1]), "the replays' inputs did not change"
    for i, (want, got) in enumerate(zip(plain, early, strict=True)):
        assert torch.equal(got, want), f"replay {i} differs" if i < NUM_REPLAYS else "the caches differ"


def test_pdl_is_off_for_cpu_tensors() -> None:
    assert not use_pdl(torch.empty(1))


@pytest.mark.gpu
def test_pdl_is_on_for_cuda_tensors_from_sm_90() -> None:
    assert use_pdl(torch.empty(1, device="cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
