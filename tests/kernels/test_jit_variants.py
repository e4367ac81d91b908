"""After a worker's warm-up, serving compiles no Triton kernel variant (a compile stalls every stream of the
worker for 0.3-1.5 s); the JIT watch that counts them sees a new variant and only a new one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels.jit_watch import JitWatch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_jit_watch_sees_a_new_variant_once() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def _double(x_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    watch, seen = JitWatch(), []
    watch.on_compile = lambda c: seen.append(c)
    assert watch.install()
    try:
        x = torch.ones(100, device="cuda")
        _double[(1,)](x, 100, BLOCK=128)  # compiled before serving
        watch.mark_served()
        _double[(1,)](x, 99, BLOCK=128)  # 99 and 100 specialize alike (neither 1 nor divisible by 16)
        assert watch.num_compiles_serving == 0
        _double[(1,)](x, 96, BLOCK=128)  # divisible by 16: a new variant
    finally:
        watch.uninstall()
    want = torch.ones(100, device="cuda") * 2
    want[:99] *= 2
    want[:96] *= 2
    assert torch.equal(x, want)
    assert watch.num_compiles == 2 and watch.num_compiles_serving == 1
    assert "_double" in seen[-1].kernel and seen[-1].seconds > 0
    assert (
        "_double[num_warps=4" in seen[-1].signature
        and "n: i32 %16" in seen[-1].signature
        and "BLOCK=128" in seen[-1].signature
    )


def test_served_passes_compile_no_kernel_after_the_warm_up(tiny_llama_dir: Path) -> None:
    """A fresh process (the JIT's in-memory cache empty, as in a worker): an engine in bf16 with the Triton
    backend and graphs, warmed up as a worker is, then prompts of assorted lengths in continuous batches
    (graphed and eager prefills, mixed prefill + decode passes, prefix hits, full hits)."""
    code = f"from tests.kernels.test_jit_variants import served_compiles; served_compiles({str(tiny_llama_dir)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert compiled == [], "\n".join(compiled)


def served_compiles(model_dir: str) -> None:
    """Prints (JSON, last line) the signatures of the kernel variants compiled after the warm-up."""
    from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from pdserve.core.engine import Engine
    from pdserve.core.sampling_params import SamplingParams
    from tests.hf_reference import random_prompts

    watch, compiled = JitWatch(), []
    watch.install()
    cfg = EngineConfig(
        ModelConfig.from_pretrained(Path(model_dir), dtype="bfloat16"),
        CacheConfig(num_blocks=1024),
        SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=256, prefill_chunk_size=128),
        device="cuda",
    )
    engine = Engine(cfg)
    engine.runner.warmup()
    watch.on_compile = lambda c: compiled.append(f"{c.seconds:.2f} s {c.signature}")
    watch.mark_served()
    lengths = (1, 2, 15, 16, 17, 32, 33, 100, 128, 129, 250, 256, 300, 3, 64, 7, 48, 480, 5, 80, 160, 31, 9, 11)
    prompts = random_prompts(1024, lengths, seed=50)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.generate(prompts, params)
    suffixes = random_prompts(1024, (7,) * len(prompts), seed=51)
    engine.generate([p + q for p, q in zip(prompts, suffixes, strict=True)], params)  # prefix hits
    engine.generate(prompts[:5], params)  # whole-prompt hits
    for n in (1, 3, 8, 9, 16, 17, 24):  # decode batches of every graph size and beyond
        engine.generate(random_prompts(1024, (4,) * n, seed=52 + n), params)
    print(json.dumps(compiled))
