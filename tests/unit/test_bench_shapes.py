"""scripts/make_bench_model.py's Qwen3 and MoE shapes: the folders it writes read back as the families and shapes
of the public configs (the weights of these shapes are dummy, made by the workers; too large to build here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.core.config import ModelConfig
from pdserve.core.models import mixtral, qwen3_moe
from tests.child_env import ROOT, child_env

# shape -> (arch, layers, hidden, heads, kv heads, head_dim, experts, top k, expert width)
EXPECTED = {
    "qwen3-8b": ("llama", 36, 4096, 32, 8, 128, 0, 0, 0),
    "qwen3-30b-a3b": ("qwen3_moe", 48, 2048, 32, 4, 128, 128, 8, 768),
    "mixtral-8x7b": ("mixtral", 32, 4096, 32, 8, 128, 8, 2, 14336),
}


@pytest.mark.parametrize("shape", list(EXPECTED))
def test_bench_shape_reads_back_as_its_family(shape: str, tmp_path: Path) -> None:
    argv = [sys.executable, str(ROOT / "scripts" / "make_bench_model.py"), "--shape", shape, "--out", str(tmp_path)]
    subprocess.run(argv, check=True, env=child_env(), capture_output=True)
    cfg = ModelConfig.from_pretrained(tmp_path, load_format="dummy")
    arch, layers, hidden, heads, kv_heads, head_dim, experts, top_k, width = EXPECTED[shape]
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size) == (arch, layers, hidden)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (heads, kv_heads, head_dim)
    assert max(cfg.eos_token_ids) < cfg.vocab_size
    if experts:
        args = (qwen3_moe if arch == "qwen3_moe" else mixtral).moe_args(cfg.hf_config)
        assert (args.num_experts, args.top_k, args.intermediate_size, args.renormalize) == (experts, top_k, width, True)
