"""Helpers the Triton kernels share: jit without triton installed, the kernel-or-reference choice, row checks,
the device's SM count, programmatic dependent launch and Triton's scratch allocator.

triton is optional here (the `gpu` extra): without it this module imports, `jit` returns the function as it is
and `use_triton` is False.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without the `gpu` extra
    triton = None  # type: ignore[assignment]

DEFAULT_NUM_SMS = 132
"""Stand-in SM count where the tensors are not on CUDA (the Triton interpreter)."""


def jit(fn: Callable[..., None]) -> Any:
    """triton.jit(fn), or fn itself where triton is not installed (the module still imports)."""
    return fn if triton is None else triton.jit(fn)


def use_triton(x: Tensor) -> bool:
    """Whether an op on x runs its kernel: a CUDA tensor and triton installed."""
    return x.is_cuda and triton is not None


def use_pdl(x: Tensor) -> bool:
    """Whether the kernels of an op on x launch with programmatic dependent launch (launch_pdl, and their PDL
    constexpr): a CUDA tensor on sm_90 or newer, outside the Triton interpreter."""
    return x.is_cuda and triton is not None and _pdl_device(x.get_device())


@functools.cache
def _pdl_device(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and not triton.knobs.runtime.interpret


@jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL, the first thing a kernel launched with launch_pdl does apart from reading weights: wait until the
    kernel before it has finished and its writes are visible, then let the kernel after it launch (which waits in
    turn). NOTE: every write comes after the wait too: under CUDA graphs or the caching allocator a buffer this
    kernel writes may be one the kernel before still reads."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def check_rows(name: str, t: Tensor, shape: torch.Size, dtype: torch.dtype) -> None:
    """Assert t is `shape` of `dtype` with a contiguous last dimension (rows are tokens; other strides free)."""
    assert t.shape == shape, f"{name} must be {tuple(shape)}, got {tuple(t.shape)}"
    assert t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}"
    assert t.stride(-1) == 1, f"{name}: the last dimension must be contiguous"


def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of device (DEFAULT_NUM_SMS off CUDA)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def set_triton_allocator() -> None:
    """Device-made TMA descriptors live in per-launch scratch that Triton asks this allocator for (from torch's
    caching allocator, on the current stream: graph captures keep theirs in the graph's pool)."""

    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)
