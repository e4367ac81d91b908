"""The JIT watch on Triton's hooks, driven by hand (CPU): compiles counted, those after the warm-up apart,
hooks already installed still called, and restored on uninstall."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.kernels import jit_watch
from pdserve.kernels.jit_watch import JitCompile, JitWatch

pytestmark = pytest.mark.skipif(jit_watch.knobs is None, reason="needs triton with knobs")


def compile_once(name: str) -> None:
    """What Triton's JIT does on an in-memory cache miss: the cache hook, the compile, the post-compile hook."""
    runtime = jit_watch.knobs.runtime  # type: ignore[union-attr]
    fn = SimpleNamespace(module="pdserve.kernels.fake", name=name)
    kwargs: dict[str, Any] = {"key": name, "repr": f"{name}[num_warps=4](n: i32)", "fn": fn}
    skip = runtime.jit_cache_hook(**kwargs, compile={}, is_manual_warmup=False, already_compiled=False)
    assert not skip
    runtime.jit_post_compile_hook(**kwargs, compile={}, is_manual_warmup=False, already_compiled=False)


def test_compiles_after_mark_served_are_counted_apart_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[JitCompile] = []
    watch = JitWatch(on_compile=seen.append)
    assert watch.install()
    try:
        compile_once("_warm")
        watch.mark_served()
        with caplog.at_level(logging.WARNING, logger="pdserve.kernels.jit_watch"):
            compile_once("_late")
    finally:
        watch.uninstall()
    assert (watch.num_compiles, watch.num_compiles_serving) == (2, 1)
    assert [c.kernel for c in seen] == ["pdserve.kernels.fake._warm", "pdserve.kernels.fake._late"]
    assert all(c.seconds >= 0 for c in seen)
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == ["_late[num_warps=4](n: i32)"]


def test_hooks_already_installed_are_chained_and_restored() -> None:
    runtime = jit_watch.knobs.runtime  # type: ignore[union-attr]
    calls: list[str] = []
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def mine_before(**kwargs: Any) -> bool:
        calls.append("before " + kwargs["key"])
        return False

    def mine_after(**kwargs: Any) -> None:
        calls.append("after " + kwargs["key"])

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = mine_before, mine_after
    try:
        watch = JitWatch()
        watch.install()
        compile_once("_k")
        watch.uninstall()
        assert calls == ["before _k", "after _k"] and watch.num_compiles == 1
        assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == (mine_before, mine_after)
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after


def test_describe_names_each_argument_s_specialization() -> None:
    params = [SimpleNamespace(is_constexpr=c) for c in (False, False, False, True)]
    kwargs = {
        "fn": SimpleNamespace(name="_k", jit_function=SimpleNamespace(params=params)),
        "compile": {
            "signature": {"x_ptr": "*bf16", "n": "i32", "m": "constexpr", "BLOCK": "constexpr"},
            "configs": [{(0,): [["tt.divisibility", 16]]}],
            "constants": {(2,): 1, (3,): 128},
            "num_warps": 4,
            "num_stages": 2,
        },
    }
    want = "_k[num_warps=4, num_stages=2](x_ptr: *bf16 %16, n: i32, m = 1, BLOCK=128)"
    assert jit_watch.describe(kwargs) == want
    assert jit_watch.describe({"repr": "raw"}) == "raw"  # a layout it does not know: Triton's repr
