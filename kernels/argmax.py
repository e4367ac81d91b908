"""Row-wise argmax of logits in Triton, split over the vocabulary: the greedy sampler's last step.

torch's argmax reduces a row in one thread block, so sampling a few rows of a 128k vocabulary keeps one SM
per row busy for ~29 us on an H200 while the rest idle. Here each row is cut into chunks of CHUNK columns, one
program per (row, chunk): each finds its chunk's maximum and first index, writes them as partials and counts
itself done on the row's counter; the row's last program (its atomic sees every other program's partial)
reduces the partials in chunk order, writes the row's index and resets the counter for the next launch. One
launch, so the host pays what torch's argmax costs it (a Triton launch takes ~30 us of Python on the H200
hosts); the GPU time is ~6 us for up to 8 rows.

Ties go to the lowest index in both steps, as torch's argmax does; a NaN counts as the maximum (torch returns
the first NaN), so a broken row is not hidden.

NOTE: the counters live in one buffer per device (ROW_COUNTERS), zero between launches: launches on two
streams at once would share them. The engine samples on one stream. triton is optional (the `gpu` extra):
argmax() takes torch's path on CPU tensors or without it.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without the `gpu` extra
    triton = None  # type: ignore[assignment]

CHUNK = 4096
"""Columns per program (a 128256-token vocabulary: 32 programs per row)."""
ROW_COUNTERS: dict[torch.device, Tensor] = {}
"""Per device: int32 [rows] counters of finished programs, grown on demand; every launch leaves them at 0."""


if triton is not None:

    @triton.jit
    def _argmax_kernel(
        x_ptr,  # [rows, vocab]
        part_val_ptr,  # [rows, num_chunks] fp32
        part_idx_ptr,  # [rows, num_chunks] int32
        count_ptr,  # [>= rows] int32, 0 on entry and on exit
        out_ptr,  # [rows] int64
        vocab,
        num_chunks,
        stride_x,
        CHUNK: tl.constexpr,
        NUM_CHUNKS_POW2: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NOTE: a NaN wins (as in torch): +inf here, found again below
        best = tl.max(x, axis=0)
        tl.store(part_val_ptr + row * num_chunks + chunk, best)
        tl.store(part_idx_ptr + row * num_chunks + chunk, tl.min(tl.where(x == best, offs, vocab), axis=0))
        # acq_rel: this program's partials are published before the count, and the last one sees them all
        if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == num_chunks - 1:
            c = tl.arange(0, NUM_CHUNKS_POW2)
            mask = c < num_chunks
            vals = tl.load(part_val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"), cache_modifier=".cg")
            idxs = tl.load(part_idx_ptr + row * num_chunks + c, mask=mask, other=0, cache_modifier=".cg")
            first = tl.min(tl.where(mask & (vals == tl.max(vals, axis=0)), c, NUM_CHUNKS_POW2), axis=0)
            tl.store(out_ptr + row, tl.sum(tl.where(c == first, idxs, 0), axis=0).to(tl.int64))
            tl.store(count_ptr + row, 0)


def _counters(device: torch.device, rows: int) -> Tensor:
    buf = ROW_COUNTERS.get(device)
    if buf is None or buf.numel() < rows:
        buf = ROW_COUNTERS[device] = torch.zeros(max(rows, 256), dtype=torch.int32, device=device)
    return buf


def argmax_triton(x: Tensor) -> Tensor:  # x: [rows, vocab] float (any dtype) -> [rows] int64
    """torch.argmax(x, dim=-1) in one launch that spreads each row over the GPU."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [rows, vocab] with contiguous rows, got {tuple(x.shape)}"
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    assert vocab > 0, "an empty vocabulary has no argmax"
    num_chunks = triton.cdiv(vocab, CHUNK)
    parts = torch.empty(2, rows, num_chunks, dtype=torch.int32, device=x.device)  # [values as fp32; indexes]
    _argmax_kernel[(rows, num_chunks)](
        x, parts[0].view(torch.float32), parts[1], _counters(x.device, rows), out, vocab, num_chunks, x.stride(0),
        CHUNK=CHUNK, NUM_CHUNKS_POW2=triton.next_power_of_2(num_chunks),
    )  # fmt: skip
    return out


def argmax(x: Tensor) -> Tensor:  # x: [rows, vocab] -> [rows] int64
    """Row-wise argmax: the Triton kernel on CUDA, torch elsewhere."""
    if x.is_cuda and triton is not None and x.dim() == 2 and x.stride(1) == 1:
        return argmax_triton(x)
    return x.argmax(dim=-1)
