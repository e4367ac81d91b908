"""A CPU install has no triton (the CPU torch wheel does not bring it, and only the `gpu` and `test` extras
name it): the worker processes, the router and the KV transports import without it, prefill and decode
workers start on CPU with the attention backend `auto`, and an engine's greedy tokens equal transformers'.

The check runs in a subprocess whose `import triton` fails as on such an install.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.child_env import child_env
from tests.hf_reference import hf_greedy, random_prompts

NEW_TOKENS = 16
LENGTHS = (1, 5, 17, 40)
ENTRY_MODULES = (
    "pdserve.prefill_worker.__main__",  # NOTE: its main() runs only under `python -m`
    "pdserve.prefill_worker.worker",
    "pdserve.decode_worker.__main__",
    "pdserve.decode_worker.worker",
    "pdserve.core.engine",
    "pdserve.router.server",
    "pdserve.kvtransfer.base",
    "pdserve.kvtransfer.cuda_ipc",
    "pdserve.kvtransfer.dist",
    "pdserve.kvtransfer.factory",
    "pdserve.kvtransfer.layout",
    "pdserve.kvtransfer.lease",
    "pdserve.kvtransfer.pool",
    "pdserve.kvtransfer.shm",
    "pdserve.kernels.triton_utils",
)
TRITON_MODULES = (
    "pdserve.kernels.block_copy",
    "pdserve.kernels.decode_attention",
    "pdserve.kernels.kv_append",
    "pdserve.kernels.prefill_attention",
    "pdserve.kernels.prefill_splits",
    "pdserve.kernels.prefill_tiles",
    "pdserve.kernels.triton_backend",
)
"""Modules that import triton unguarded: the CUDA path alone loads them."""

CHILD = """
import sys

sys.modules["triton"] = None  # `import triton` raises ImportError, as on a CPU install without the `gpu` extra

import importlib
import json
import shutil
import tempfile

from pdserve.core.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.core.engine import Engine
from pdserve.core.sampling_params import SamplingParams

model_dir, prompts, new_tokens, modules = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
for name in modules:
    importlib.import_module(name)
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.prefill_worker.worker import PrefillWorker

cfg = EngineConfig(ModelConfig.from_pretrained(model_dir), CacheConfig(num_blocks=64), device="cpu")
assert cfg.attention_backend == "auto"
run_dir = tempfile.mkdtemp(prefix="pdnt")  # NOTE: short: ipc:// paths are limited to ~100 bytes
try:
    prefill = PrefillWorker(cfg, 0, run_dir, num_decode=1, transport="shm")
    decode = DecodeWorker(cfg, 0, run_dir, num_prefill=1, transport="shm")
    backends = [type(w.engine.runner.backend).__name__ for w in (prefill, decode)]
    decode.close()
    prefill.close()
finally:
    shutil.rmtree(run_dir, ignore_errors=True)
greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
tokens = Engine(cfg).generate(prompts, greedy)
kernels = sorted(name for name in sys.modules if name.startswith("pdserve.kernels."))
blocked = sys.modules["triton"] is None
print(json.dumps({"backends": backends, "tokens": tokens, "kernels": kernels, "triton_blocked": blocked}))
"""


def run_without_triton(tmp_path: Path, model_dir: Path, prompts: list[list[int]]) -> dict:
    """What CHILD reports, run from tmp_path with the repo root on PYTHONPATH (for tests.* helpers)."""
    argv = [sys.executable, "-c", CHILD, str(model_dir), json.dumps(prompts), str(NEW_TOKENS), *ENTRY_MODULES]
    proc = subprocess.run(argv, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cpu_workers_start_and_engine_matches_hf_without_triton(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompts = random_prompts(1024, LENGTHS, seed=32)
    report = run_without_triton(tmp_path, tiny_llama_dir, prompts)
    assert report["triton_blocked"], "something put a triton module in place"
    assert not set(report["kernels"]) & set(TRITON_MODULES)
    assert report["backends"] == ["TorchAttention", "TorchAttention"]
    assert report["tokens"] == hf_greedy(tiny_llama_dir, prompts, NEW_TOKENS)
