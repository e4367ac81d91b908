"""What the router knows about the served model, read from the model folder's JSON files (no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# NOTE: mirrors core.config.ModelConfig.from_hf_config, which the router cannot import (it imports torch).
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions")


@dataclass(frozen=True)
class ModelSpec:
    """The served model's limits, as the workers' engines see them."""

    name: str
    """Folder name of the model."""
    vocab_size: int
    """Rows of the embedding table; valid token ids are [0, vocab_size)."""
    max_model_len: int
    """Prompt plus generated tokens may not exceed this."""
    eos_token_ids: tuple[int, ...]
    """Tokens that end generation unless ignore_eos."""

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        """Read config.json (and generation_config.json for the eos ids)."""
        path = Path(model_dir)
        config = _read_json(path / "config.json")
        if config is None:
            raise FileNotFoundError(f"{path / 'config.json'} is missing or not JSON")
        max_len = next((config[k] for k in _MAX_LEN_KEYS if isinstance(config.get(k), int)), None)
        if not isinstance(config.get("vocab_size"), int) or max_len is None:
            raise ValueError(f"{path / 'config.json'} lacks vocab_size or max_position_embeddings")
        generation = _read_json(path / "generation_config.json") or {}
        eos = generation.get("eos_token_id")
        eos = config.get("eos_token_id") if eos is None else eos
        return cls(path.resolve().name, config["vocab_size"], max_len, _as_ids(eos))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
