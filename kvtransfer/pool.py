"""KV pool allocation: one contiguous tensor per worker, in POSIX shared memory when another process reads it.

A model runner allocates its pool here (through ModelRunner's kv_allocator) and sees per-layer views
`pool.tensor[i]` of shape [2, num_blocks, block_size, num_kv_heads, head_dim].

NOTE (shared CPU pools): the segment is created with multiprocessing.shared_memory.SharedMemory (unique
name, registered with the creator's resource tracker, which unlinks it if the creator dies without
close()), but the tensor maps the segment itself through torch.from_file (/dev/shm/<name>, MAP_SHARED).
So the mapping lives exactly as long as the tensor and its views, and close() can never leave a view
pointing at unmapped memory. An attaching process maps the file the same way and never touches
SharedMemory, so its resource tracker neither unlinks the creator's segment nor warns about a "leak".
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np
import torch

from pdserve.kvtransfer.layout import KVLayout

SHM_DIR = Path("/dev/shm")
"""Where POSIX shared memory segments appear as files (Linux)."""
SHM_PREFIX = "pdserve_kv_"
"""Every pool segment's name starts with this; a sink maps no other name."""
_SHM_NAME = re.compile(re.escape(SHM_PREFIX) + r"[A-Za-z0-9_]+")
_SHM_OWNER = re.compile(re.escape(SHM_PREFIX) + r"(\d+)_[0-9a-f]+")


@dataclass(eq=False)
class KVPool:
    """One KV pool tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], and the shared
    memory segment behind it when there is one."""

    layout: KVLayout
    """Shape and dtype of tensor."""
    tensor: torch.Tensor
    """The whole pool; the model runner's per-layer KV caches are views of it."""
    shm_name: str | None = None
    """Name of the shared memory segment holding tensor (CPU shared pools), else None."""
    _segment: SharedMemory | None = field(default=None, repr=False)
    """Set only in the process that created the segment: it unlinks the name on close()."""

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def owns_segment(self) -> bool:
        """True in the creating process until close()."""
        return self._segment is not None

    def layer_views(self) -> list[torch.Tensor]:
        """Per layer [2, num_blocks, block_size, num_kv_heads, head_dim] views of the pool (no copy)."""
        return list(self.tensor.unbind(0))

    def close(self) -> None:
        """Unlink the shared memory segment if this process created it; idempotent.

        Existing views stay valid: the memory is freed once every process has dropped its mapping
        (the last tensor view). No process can attach to the pool after close().
        """
        segment, self._segment = self._segment, None
        if segment is not None:
            with contextlib.suppress(FileNotFoundError):  # someone else unlinked it already
                segment.unlink()


def allocate_kv_pool(layout: KVLayout, device: torch.device | str, shared: bool) -> KVPool:
    """A zero-filled pool of layout on device; shared=True puts it in POSIX shared memory (CPU only).

    CUDA pools are always exportable through the cuda_ipc transport, so shared must be False for them.
    """
    device = torch.device(device)
    if not shared and device.type == "cpu":
        return KVPool(layout, _lazy_zeros(layout))
    if not shared:
        return KVPool(layout, torch.zeros(layout.shape, dtype=layout.torch_dtype, device=device))
    if device.type != "cpu":
        raise ValueError(f"shared KV pools live in CPU shared memory, not on {device}; use cuda_ipc on CUDA")
    return _allocate_shm_pool(layout)


def _lazy_zeros(layout: KVLayout) -> torch.Tensor:
    """A CPU pool from calloc: large blocks come zeroed from the kernel as pages are first touched, instead of
    one memset of the whole pool at start-up (SmolLM2, 1024 blocks: 755 MB, 0.8-1.6 s of a restart on a loaded
    2-core host)."""
    raw = torch.from_numpy(np.zeros(layout.nbytes, dtype=np.uint8))
    return raw.view(layout.torch_dtype).view(layout.shape)


def attach_shm_pool(name: str, layout: KVLayout) -> KVPool:
    """Map another process's shared pool `name` (created with layout); the result does not own the name.

    FileNotFoundError when the segment is gone (its creator closed or died); ValueError when name is not
    a pool segment or is smaller than layout.
    """
    if not _SHM_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a KV pool segment name ({SHM_PREFIX}...)")
    return KVPool(layout, _map_segment(name, layout), shm_name=name)


def remove_stale_segments() -> list[str]:
    """Unlink pool segments whose creating process is gone; their names.

    NOTE: a creator killed with its resource tracker (SIGKILL to the whole process group) leaves its
    segment behind; a supervisor or a starting prefill worker calls this to sweep such leftovers.
    Assumes the processes sharing /dev/shm share one PID namespace (not so across containers).
    """
    removed = []
    for path in SHM_DIR.glob(SHM_PREFIX + "*"):
        match = _SHM_OWNER.fullmatch(path.name)
        if match is not None and not _process_alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return sorted(removed)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _allocate_shm_pool(layout: KVLayout) -> KVPool:
    _check_shm_space(layout.nbytes)
    segment = SharedMemory(name=f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(8)}", create=True, size=layout.nbytes)
    try:
        tensor = _map_segment(segment.name, layout)  # a new segment reads as zeros
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    segment.close()  # NOTE: only drops SharedMemory's own mapping and fd; the tensor keeps its mapping
    return KVPool(layout, tensor, shm_name=segment.name, _segment=segment)


def _map_segment(name: str, layout: KVLayout) -> torch.Tensor:
    path = SHM_DIR / name
    size = path.stat().st_size
    if size < layout.nbytes:
        raise ValueError(f"shared memory segment {name} has {size} bytes, the layout needs {layout.nbytes}")
    numel = layout.nbytes // layout.torch_dtype.itemsize
    flat = torch.from_file(str(path), shared=True, size=numel, dtype=layout.torch_dtype)
    return flat.view(layout.shape)


def _check_shm_space(nbytes: int) -> None:
    """Refuse a pool /dev/shm cannot hold: writing past its space would kill the process with SIGBUS."""
    if not SHM_DIR.is_dir():
        raise RuntimeError(f"shared KV pools need POSIX shared memory at {SHM_DIR} (Linux)")
    stats = os.statvfs(SHM_DIR)
    free = stats.f_bavail * stats.f_frsize
    if free < nbytes:
        raise MemoryError(
            f"KV pool of {nbytes} bytes does not fit in {SHM_DIR} ({free} bytes free): "
            "lower CacheConfig.num_blocks / memory_fraction or enlarge /dev/shm"
        )
