"""Watches Triton's JIT: every kernel variant compiled in this process, with its specialization and time.

A serving worker compiles its kernels in the warm-up; a compile after it stalls every stream of the worker for
the compile's duration (0.3-1.5 s on an H200 host) and means a launch took a specialization the warm-up did not
(Triton specializes on pointer alignment and on integers equal to 1 or divisible by 16). Workers count these
(`pdserve_jit_compiles_total`) and log each one with the kernel's argument types, which name the culprit.

NOTE: installs Triton's process-wide `jit_cache_hook` and `jit_post_compile_hook` (called on an in-memory
cache miss only, never on a launch of a compiled kernel); a hook already installed is chained.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

try:
    from triton import knobs
except ImportError:  # pragma: no cover - CPU installs without the `gpu` extra, or a Triton before knobs
    knobs = None

log = logging.getLogger(__name__)
Hook = Callable[..., Any]


@dataclass(frozen=True)
class JitCompile:
    """One kernel variant compiled."""

    kernel: str
    """The kernel's qualified name."""
    signature: str
    """Triton's description: launch options and each argument's type and specialization."""
    seconds: float
    """Wall time from the cache miss to the compiled kernel (a disk-cache hit is quick)."""


def describe(hook_kwargs: dict[str, Any]) -> str:
    """A compile's kernel, options and specialized arguments: `n: i32 %16` (divisible by 16), `n = 1` (a value
    made constant), constexpr parameters with their values; Triton's own `repr` where its layout is unknown."""
    try:
        compile_info, fn = hook_kwargs["compile"], hook_kwargs["fn"]
        params = fn.jit_function.params
        attrs, constants = compile_info["configs"][0], compile_info["constants"]
        parts = []
        for i, (name, kind) in enumerate(compile_info["signature"].items()):
            if kind == "constexpr":
                parts.append(f"{name}={constants[(i,)]}" if params[i].is_constexpr else f"{name} = {constants[(i,)]}")
            else:
                divisible = any(attr[0] == "tt.divisibility" for attr in attrs.get((i,), ()))
                parts.append(f"{name}: {kind}{' %16' if divisible else ''}")
        options = f"num_warps={compile_info['num_warps']}, num_stages={compile_info['num_stages']}"
        return f"{fn.name}[{options}]({', '.join(parts)})"
    except (KeyError, IndexError, AttributeError, TypeError):
        return str(hook_kwargs.get("repr", ""))


class JitWatch:
    """Records compiles; `mark_served()` splits warm-up compiles from those that happened while serving."""

    def __init__(self, on_compile: Callable[[JitCompile], None] | None = None) -> None:
        self.num_compiles = 0
        self.num_compiles_serving = 0
        self.serving = False
        self.on_compile = on_compile
        self._started: dict[int, float] = {}  # thread id -> monotonic start of its compile
        self._lock = threading.Lock()
        self._chained: tuple[Hook | None, Hook | None] = (None, None)

    def install(self) -> bool:
        """Hook Triton's JIT; False where Triton (with knobs) is not installed."""
        if knobs is None:
            return False
        runtime = knobs.runtime
        self._chained = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        return True

    def uninstall(self) -> None:
        if knobs is not None and knobs.runtime.jit_cache_hook == self._before:
            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._chained

    def mark_served(self) -> None:
        """From now on every compile is one the warm-up missed: logged as a warning and counted."""
        self.serving = True

    def _before(self, **kwargs: Any) -> bool:
        self._started[threading.get_ident()] = time.monotonic()
        chained = self._chained[0]
        return bool(chained(**kwargs)) if chained is not None else False  # NOTE: True would skip the compile

    def _after(self, **kwargs: Any) -> Any:
        start = self._started.pop(threading.get_ident(), None)
        seconds = 0.0 if start is None else time.monotonic() - start
        fn = kwargs.get("fn")
        name = f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}"
        self.record(JitCompile(name, describe(kwargs), seconds))
        chained = self._chained[1]
        return chained(**kwargs) if chained is not None else None

    def record(self, compiled: JitCompile) -> None:
        with self._lock:
            self.num_compiles += 1
            if self.serving:
                self.num_compiles_serving += 1
        if self.serving:
            log.warning("Triton compiled a kernel variant while serving (%.2f s): %s", compiled.seconds,
                        compiled.signature)  # fmt: skip
        if self.on_compile is not None:
            self.on_compile(compiled)
