"""The TP group's sum of a row-parallel layer's partial outputs fused with the residual add and RMSNorm that
follow it (Triton over symmetric memory): one kernel where the unfused path launches three (a copy into the
symmetric buffer, the one-shot all-reduce, the norm).

The data is its own flag (Lamport's scheme, as TensorRT-LLM's low-latency all-reduce): every rank writes its
partial rows straight into every peer's buffer, and a reader waits until no element of what it reads is still
the sentinel -0.0 (a written -0.0 goes as +0.0: the same sum). No flag, no barrier and no remote read sits on
the critical path, only one NVLink write.

Memory (core/parallel.py FusedAllReduceNorm allocates and maps it; every rank alike):
    buffer     [SLOTS, world, rows, hidden] symmetric, every element -0.0 at start: slot s, region q holds rank
               q's partial rows of the call using slot s
    slot_rows  [SLOTS] int32, local: rows of the last call that used each slot (what the clean-up clears)
    epochs     [PROGRAMS] int32, local: the number of the call each program runs next (from 1)

A launch always has PROGRAMS programs; program p owns rows p, p + PROGRAMS, ... of every call, so its epoch
stays in step with its peers' program p whatever the row count. Call e uses slot e % SLOTS. Program p of call e:
    1. writes its rows of x into region `rank` of slot e % SLOTS of every rank's buffer (unless the producer of a
       one-row x already did: kernels/gemv.py writes its output there as it computes it, PeerRows),
    2. waits until the other regions of those rows hold no sentinel, sums the rows over the ranks in rank order
       (float32, so every rank gets the same bits), rounds to x's dtype as an all-reduce would, adds the
       residual and normalizes as kernels/fused_ops.py's RMSNorm does,
    3. sets its rows of slot (e - 1) % SLOTS back to the sentinel.
Why three slots suffice: a peer writes call e + 2's rows (the slot step 3 clears) only after it has read our
rows of call e + 1, which we write after this call; and it writes call e + 1's rows (another slot) while we may
still read call e's. A wait that lasts SPIN_TIMEOUT_NS traps (a dead peer fails the process instead of hanging).

Every rank must make the same sequence of calls (the group's ranks run the same passes in the same order),
eagerly or inside CUDA graphs.

NOTE: triton is optional (the `gpu` extra): without it this module imports and nothing here can launch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from pdserve.kernels.triton_utils import pdl_wait

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without the `gpu` extra
    triton = None  # type: ignore[assignment]

PROGRAMS = 64
"""Programs per launch: the rows of a decode batch of up to 64 sequences each get their own."""
SLOTS = 3
"""Buffers a rank cycles through: the call being read, the next one a peer may already write, the one cleared."""
SPIN_TIMEOUT_NS = 30_000_000_000
"""How long a program waits on a peer before it traps (the TP group's collective timeout is 60 s)."""
SENTINEL_BITS = {16: -(2**15), 32: -(2**31)}
"""Element width -> the bits of -0.0 as a signed integer of that width (the sign bit alone)."""


class PeerRows(NamedTuple):
    """Where a producer writes a one-row partial output for the fused sum that follows it: rank `rank`'s region of
    the slot that sum will use (row 0 is program 0's: epochs[0] picks the slot), in every peer's buffer."""

    buffer_ptrs: Tensor  # [world] int64
    epochs: Tensor  # [PROGRAMS] int32
    capacity: int
    rank: int


def fill_sentinel(buffer: Tensor) -> None:
    """Every element of buffer (a 16- or 32-bit float tensor) set to -0.0, the 'not written yet' mark."""
    bits = buffer.element_size() * 8
    buffer.view({16: torch.int16, 32: torch.int32}[bits]).fill_(SENTINEL_BITS[bits])


if triton is not None:
    SENTINEL_INT = {16: tl.int16, 32: tl.int32}
    """Element width -> the integer type the kernel reads a float's bits as."""

    @triton.jit
    def _now_ns(anchor):
        """The GPU's global timer (ns); anchor only gives the asm an operand."""
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,r", [anchor], dtype=tl.int64, is_pure=False, pack=1
        )

    @triton.jit
    def _trap(anchor):
        tl.inline_asm_elementwise("trap;", "=r,r", [anchor], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _buffer(buffer_ptrs, q, dtype: tl.constexpr):
        """Rank q's buffer as mapped here (symmetric memory is allocated 16-byte aligned or better)."""
        return tl.multiple_of(tl.load(buffer_ptrs + q).to(tl.pointer_type(dtype)), 16)

    @triton.jit
    def _without_sentinel(v, INT: tl.constexpr, SENTINEL: tl.constexpr):
        """v with every -0.0 made +0.0 (in integer ops, which no float rewrite can fold away)."""
        bits = v.to(INT, bitcast=True)
        return tl.where(bits == SENTINEL, 0, bits).to(v.dtype, bitcast=True)

    @triton.jit
    def _wait_written(ptr, mask, INT: tl.constexpr, SENTINEL: tl.constexpr, TIMEOUT_NS: tl.constexpr):
        """The elements at ptr once none of them is the sentinel (volatile loads: a peer's NVLink writes land
        there); trap after TIMEOUT_NS."""
        part = tl.load(ptr, mask=mask, other=0.0, volatile=True)
        start = _now_ns(SENTINEL)
        while tl.max(((part.to(INT, bitcast=True) == SENTINEL) & mask).to(tl.int32), axis=0) > 0:
            if _now_ns(SENTINEL) - start > TIMEOUT_NS:
                _trap(SENTINEL)
            part = tl.load(ptr, mask=mask, other=0.0, volatile=True)
        return part

    @triton.jit
    def _add_and_normalize(total, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, offs, mask, hidden, eps):
        """One row: the fp32 sum rounded to the dtype as an all-reduce rounds it, + the residual (stored), then
        kernels/fused_ops.py's RMSNorm of that (stored)."""
        dtype = out_ptr.dtype.element_ty
        r = tl.load(residual_ptr + offs, mask=mask, other=0.0)
        s = (total.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)  # the all-reduce's bits, then +
        tl.store(residual_out_ptr + offs, s, mask=mask)
        s32 = s.to(tl.float32)
        normed = (s32 * tl.math.rsqrt(tl.sum(s32 * s32, axis=0) / hidden + eps)).to(dtype)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, (normed.to(tl.float32) * w.to(tl.float32)).to(dtype), mask=mask)

    @triton.jit
    def _clear_rows(slot_ptr, num_rows, region, offs, mask, hidden, pid, RANK: tl.constexpr, WORLD: tl.constexpr,
                    PROGRAMS: tl.constexpr, INT: tl.constexpr, SENTINEL: tl.constexpr):  # fmt: skip
        """This program's rows of a slot (its first num_rows rows) back to the sentinel, in every peer's region."""
        sentinel = tl.full(offs.shape, SENTINEL, INT).to(slot_ptr.dtype.element_ty, bitcast=True)
        for row in range(pid, num_rows, PROGRAMS):
            base = tl.cast(row, tl.int64) * hidden
            for q in tl.static_range(WORLD):
                if q != RANK:
                    tl.store(slot_ptr + base + q * region + offs, sentinel, mask=mask)

    @triton.jit(do_not_specialize=["num_rows"])
    def _all_reduce_rms_norm_kernel(
        x_ptr,  # [num_rows, hidden]: this rank's partial sums, rows contiguous
        residual_ptr,  # [num_rows, hidden]
        weight_ptr,  # [hidden]
        out_ptr,  # [num_rows, hidden]: rms_norm(sum + residual)
        residual_out_ptr,  # [num_rows, hidden]: sum + residual
        buffer_ptrs,  # [WORLD] int64: each rank's buffer [SLOTS, WORLD, capacity, hidden], as mapped here
        slot_rows_ptr,  # [SLOTS] int32
        epochs_ptr,  # [PROGRAMS] int32
        num_rows,
        capacity,
        hidden,
        eps,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        PROGRAMS: tl.constexpr,
        SLOTS: tl.constexpr,
        INT: tl.constexpr,
        SENTINEL: tl.constexpr,
        BLOCK: tl.constexpr,
        TIMEOUT_NS: tl.constexpr,
        PUSHED: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_wait(PDL)  # NOTE: before the epochs, the slots and the peers' buffers are touched
        pid = tl.program_id(0)
        dtype = x_ptr.dtype.element_ty
        offs = tl.arange(0, BLOCK)
        mask = offs < hidden
        epoch = tl.load(epochs_ptr + pid)
        region = tl.cast(capacity, tl.int64) * hidden
        slot = (epoch % SLOTS) * WORLD * region
        mine = _buffer(buffer_ptrs, RANK, dtype)
        for row in range(pid, num_rows if not PUSHED else 0, PROGRAMS):  # NOTE: PUSHED: the producer wrote them
            base = tl.cast(row, tl.int64) * hidden
            part = _without_sentinel(tl.load(x_ptr + base + offs, mask=mask), INT, SENTINEL)
            for q in tl.static_range(WORLD):
                if q != RANK:
                    peer = _buffer(buffer_ptrs, q, dtype)
                    tl.store(peer + slot + RANK * region + base + offs, part, mask=mask)
        for row in range(pid, num_rows, PROGRAMS):
            base = tl.cast(row, tl.int64) * hidden
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for q in tl.static_range(WORLD):  # NOTE: rank order on every rank: the same bits everywhere
                if q == RANK:
                    part = _without_sentinel(tl.load(x_ptr + base + offs, mask=mask, other=0.0), INT, SENTINEL)
                else:
                    part = _wait_written(mine + slot + q * region + base + offs, mask, INT, SENTINEL, TIMEOUT_NS)
                total += part.to(tl.float32)
            _add_and_normalize(total, residual_ptr + base, weight_ptr, out_ptr + base, residual_out_ptr + base,
                               offs, mask, hidden, eps)  # fmt: skip
        previous = (epoch + SLOTS - 1) % SLOTS
        rows = tl.load(slot_rows_ptr + previous)
        _clear_rows(mine + previous * WORLD * region, rows, region, offs, mask, hidden, pid, RANK, WORLD, PROGRAMS,
                    INT, SENTINEL)  # fmt: skip
        if pid == 0:
            tl.store(slot_rows_ptr + epoch % SLOTS, num_rows)
        tl.store(epochs_ptr + pid, epoch + 1)


def all_reduce_rms_norm(
    x: Tensor,  # [num_rows, hidden]: this rank's partial sums
    residual: Tensor,  # [num_rows, hidden]
    weight: Tensor,  # [hidden], x's dtype
    eps: float,
    buffer_ptrs: Tensor,  # [world] int64: each rank's buffer [SLOTS, world, capacity, hidden]
    slot_rows: Tensor,  # [SLOTS] int32
    epochs: Tensor,  # [PROGRAMS] int32
    capacity: int,
    rank: int,
    pushed: bool = False,
    pdl: bool = False,
) -> tuple[Tensor, Tensor]:  # (rms_norm(sum + residual), sum + residual), new tensors
    """(rms_norm(sum over ranks of x + residual), sum + residual) in one launch; the caller checks that the
    message fits the buffer (core/parallel.py FusedAllReduceNorm.fits). With pushed, x's one row is already in the
    peers' buffers (the GEMV that made it wrote it there, kernels/gemv.py with PeerRows). With pdl
    (triton_utils.use_pdl), a programmatic dependent launch."""
    num_rows, hidden = x.shape
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    block, bits = triton.next_power_of_2(hidden), x.element_size() * 8
    _all_reduce_rms_norm_kernel[(PROGRAMS,)](
        x, residual, weight, out, residual_out, buffer_ptrs, slot_rows, epochs, num_rows, capacity, hidden, eps,
        RANK=rank, WORLD=buffer_ptrs.numel(), PROGRAMS=PROGRAMS, SLOTS=SLOTS, INT=SENTINEL_INT[bits],
        SENTINEL=SENTINEL_BITS[bits], BLOCK=block, TIMEOUT_NS=SPIN_TIMEOUT_NS, PUSHED=pushed, PDL=pdl,
        num_warps=min(16, max(1, block // 256)),  # NOTE: fused_ops.py's RMSNorm's: the same reduction, bits
        launch_pdl=pdl,
    )  # fmt: skip
    return out, residual_out
