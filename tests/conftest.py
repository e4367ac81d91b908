"""Shared pytest fixtures: model folders built once per session."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.core.model_store import ModelAssetMissingError, prepare_default_model
from pdserve.router.tokenizer import RouterTokenizer
from tests.models import make_tiny, make_tiny_gpt2, make_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama folder (seed 0): 4 layers, GQA 4/2 heads, vocab 1024 with its tokenizer."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2 folder (seed 0): 3 layers, real GPT-2 vocab and tokenizer."""
    return make_tiny_gpt2(tmp_path_factory.mktemp("tiny_gpt2"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 folder (seed 0): 2 layers, q/k norms, head_dim 32 (not hidden / heads), vocab 1024."""
    return make_tiny("qwen3", tmp_path_factory.mktemp("tiny_qwen3"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-MoE folder (seed 0): 3 layers (the middle one dense), 4 experts top 2, vocab 1024."""
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Mixtral folder (seed 0): 2 layers, 4 experts top 2, vocab 1024."""
    return make_tiny("mixtral", tmp_path_factory.mktemp("tiny_mixtral"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2-MoE folder (seed 0): 2 layers, 4 experts top 2 and a gated shared expert, vocab 1024."""
    return make_tiny("qwen2_moe", tmp_path_factory.mktemp("tiny_qwen2_moe"), seed=0)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder in the shared cache (converted on first use)."""
    try:
        return prepare_default_model()
    except ModelAssetMissingError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> RouterTokenizer:
    """The router's tokenizer of the bundled SmolLM2."""
    return RouterTokenizer.from_dir(smollm2_dir)


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A fresh, empty run directory with a short path (ipc:// socket paths are limited to ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="pd-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


SLOW_DIRS = ("e2e", "reliability")
"""Folders whose tests start real clusters: all marked `slow` (the fast lane is `scripts/test.sh -m "not slow"`)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests under SLOW_DIRS are marked `slow`; tests marked `gpu` are skipped where torch sees no CUDA device."""
    import torch

    for item in items:
        if item.path.parent.name in SLOW_DIRS:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
