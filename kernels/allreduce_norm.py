"""The TP group's sum of a row-parallel layer's partial outputs fused with the residual add and RMSNorm that
follow it (Triton over symmetric memory): one kernel where the unfused path launches three (a copy into the
symmetric buffer, the one-shot all-reduce, the norm).

Memory (core/parallel.py FusedAllReduceNorm allocates and maps it; every rank alike):
    buffer  [rows * hidden] symmetric: this rank's partial rows, read by every peer over NVLink
    flags   [2, PROGRAMS, world] int32 symmetric: flags[0, p, q] = the last call in which peer q's program p had
            copied its rows ("ready"), flags[1, p, q] = the last call in which it had read ours ("done")
    epochs  [PROGRAMS] int32, local: the number of the call each program runs next (from 1)

A launch always has PROGRAMS programs; program p owns rows p, p + PROGRAMS, ... of every call, so its epoch
and flags stay in step with its peers' program p whatever the row count. Program p of call e:
    1. waits until every peer has read our rows of call e - 1 (done == e - 1),
    2. copies its rows of x into our buffer, then tells each peer "ready e",
    3. waits for every peer's "ready e", sums the rows over the ranks in rank order (float32, so every rank
       gets the same bits), rounds to x's dtype as an all-reduce would, adds the residual and normalizes as
       kernels/fused_ops.py's RMSNorm does,
    4. tells each peer "done e".
Only step 3's wait is on the critical path: the peers read our previous rows long before we rewrite them.
A wait that lasts SPIN_TIMEOUT_NS traps (a dead peer fails the process instead of hanging it).

Flags and epochs only ever move forward together on all ranks: every rank must make the same sequence of
calls (the group's ranks run the same passes in the same order), eagerly or inside CUDA graphs.

NOTE: triton is optional (the `gpu` extra): without it this module imports and nothing here can launch.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without the `gpu` extra
    triton = None  # type: ignore[assignment]

PROGRAMS = 64
"""Programs per launch: the rows of a decode batch of up to 64 sequences each get their own."""
SPIN_TIMEOUT_NS = 30_000_000_000
"""How long a program waits on a peer before it traps (the TP group's collective timeout is 60 s)."""


if triton is not None:

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
    def _wait_flag(flag_ptr, value, TIMEOUT_NS: tl.constexpr):
        """Spin until *flag_ptr == value (acquire at system scope: the peer's writes before its release are
        visible after); trap after TIMEOUT_NS."""
        start = _now_ns(value)
        while tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys") != value:
            if _now_ns(value) - start > TIMEOUT_NS:
                _trap(value)

    @triton.jit
    def _signal_peers(flag_ptrs, index, value, RANK: tl.constexpr, WORLD: tl.constexpr):
        """flags[index] = value on every peer (release at system scope, after this program's writes)."""
        tl.debug_barrier()  # NOTE: every thread's writes before the one thread's release
        for q in tl.static_range(WORLD):
            if q != RANK:
                peer = tl.load(flag_ptrs + q).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(peer + index, value, sem="release", scope="sys")

    @triton.jit(do_not_specialize=["num_rows"])
    def _all_reduce_rms_norm_kernel(
        x_ptr,  # [num_rows, hidden]: this rank's partial sums, rows contiguous
        residual_ptr,  # [num_rows, hidden]
        weight_ptr,  # [hidden]
        out_ptr,  # [num_rows, hidden]: rms_norm(sum + residual)
        residual_out_ptr,  # [num_rows, hidden]: sum + residual
        buffer_ptrs,  # [WORLD] int64: each rank's symmetric buffer, as mapped here
        flag_ptrs,  # [WORLD] int64: each rank's flags [2, PROGRAMS, WORLD]
        epochs_ptr,  # [PROGRAMS] int32
        num_rows,
        hidden,
        eps,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        PROGRAMS: tl.constexpr,
        BLOCK: tl.constexpr,
        TIMEOUT_NS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        dtype = x_ptr.dtype.element_ty
        offs = tl.arange(0, BLOCK)
        mask = offs < hidden
        epoch = tl.load(epochs_ptr + pid)
        flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
        ready, done = pid * WORLD, (PROGRAMS + pid) * WORLD  # this program's [WORLD] slots of each kind
        mine = tl.load(buffer_ptrs + RANK).to(tl.pointer_type(dtype))
        for q in tl.static_range(WORLD):
            if q != RANK:
                _wait_flag(flags + done + q, epoch - 1, TIMEOUT_NS)
        for row in range(pid, num_rows, PROGRAMS):
            base = tl.cast(row, tl.int64) * hidden
            tl.store(mine + base + offs, tl.load(x_ptr + base + offs, mask=mask), mask=mask)
        _signal_peers(flag_ptrs, ready + RANK, epoch, RANK, WORLD)
        for q in tl.static_range(WORLD):
            if q != RANK:
                _wait_flag(flags + ready + q, epoch, TIMEOUT_NS)
        for row in range(pid, num_rows, PROGRAMS):
            base = tl.cast(row, tl.int64) * hidden
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for q in tl.static_range(WORLD):  # NOTE: rank order on every rank: the same bits everywhere
                if q == RANK:
                    part = tl.load(x_ptr + base + offs, mask=mask, other=0.0)
                else:
                    peer = tl.load(buffer_ptrs + q).to(tl.pointer_type(dtype))
                    part = tl.load(peer + base + offs, mask=mask, other=0.0, cache_modifier=".cv")
                total += part.to(tl.float32)
            r = tl.load(residual_ptr + base + offs, mask=mask, other=0.0)
            s = (total.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)  # the all-reduce's bits, then +
            tl.store(residual_out_ptr + base + offs, s, mask=mask)
            s32 = s.to(tl.float32)
            normed = (s32 * tl.math.rsqrt(tl.sum(s32 * s32, axis=0) / hidden + eps)).to(dtype)
            w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
            tl.store(out_ptr + base + offs, (normed.to(tl.float32) * w.to(tl.float32)).to(dtype), mask=mask)
        _signal_peers(flag_ptrs, done + RANK, epoch, RANK, WORLD)
        tl.store(epochs_ptr + pid, epoch + 1)


def all_reduce_rms_norm(
    x: Tensor,  # [num_rows, hidden]: this rank's partial sums
    residual: Tensor,  # [num_rows, hidden]
    weight: Tensor,  # [hidden], x's dtype
    eps: float,
    buffer_ptrs: Tensor,  # [world] int64
    flag_ptrs: Tensor,  # [world] int64
    epochs: Tensor,  # [PROGRAMS] int32
    rank: int,
) -> tuple[Tensor, Tensor]:  # (rms_norm(sum + residual), sum + residual), new tensors
    """(rms_norm(sum over ranks of x + residual), sum + residual) in one launch; the caller checks that the
    message fits the buffer (core/parallel.py FusedAllReduceNorm.fits)."""
    num_rows, hidden = x.shape
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    _all_reduce_rms_norm_kernel[(PROGRAMS,)](
        x, residual, weight, out, residual_out, buffer_ptrs, flag_ptrs, epochs, num_rows, hidden, eps,
        RANK=rank, WORLD=buffer_ptrs.numel(), PROGRAMS=PROGRAMS, BLOCK=block, TIMEOUT_NS=SPIN_TIMEOUT_NS,
        num_warps=min(16, max(1, block // 256)),  # NOTE: fused_ops.py's RMSNorm's: the same reduction, bits
    )  # fmt: skip
    return out, residual_out
