"""Tests under tests/gpu need a CUDA device: each is marked `gpu` and skipped where torch sees none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
