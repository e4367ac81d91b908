"""Activation functions by their Hugging Face config name (hidden_act / activation_function).

NOTE: not transformers.activations: importing it pulls in most of transformers (seconds per worker start,
which is how long a crashed worker takes to come back); the common ones are one torch call each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]

_ACTIVATIONS: dict[str, Activation] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_fast": functools.partial(F.gelu, approximate="tanh"),
}


def activation(name: str) -> Activation:
    """The activation a config names; anything uncommon comes from transformers (imported only then)."""
    found = _ACTIVATIONS.get(name)
    if found is not None:
        return found
    from transformers.activations import ACT2FN

    return ACT2FN[name]  # type: ignore[no-any-return]
