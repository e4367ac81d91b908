"""When a prefill pass splits its cached prefixes (split-KV, kernels/prefill_splits.py): the host's side.

Plain Python, no torch or triton: the model runner and prefill graphs decide on splits on every device, and
a CPU install has no triton (kernels/prefill_splits.py holds the kernels that need it).
"""

from __future__ import annotations

SPLIT_MAX_TOKENS = 256
"""Passes of at most this many new tokens split their cached prefixes (longer ones fill the GPU unsplit)."""
NUM_SPLITS = 8
"""Programs per (head, query tile, sequence) of a split pass: the most ranges a prefix is cut into."""
MIN_SPLIT_TILES = 2
"""Key tiles a split walks at least: a prefix of under 2 * MIN_SPLIT_TILES tiles runs unsplit."""
SPLIT_MIN_PREFIX = 2048
"""A pass splits when one of its sequences has at least this many cached tokens (see the NOTE in
kernels/prefill_splits.py)."""


def choose_num_splits(num_tokens: int, max_prefix_len: int) -> int:
    """Split programs per (head, query tile, sequence) of a pass of num_tokens new tokens whose longest cached
    prefix has max_prefix_len tokens."""
    return NUM_SPLITS if num_tokens <= SPLIT_MAX_TOKENS and max_prefix_len >= SPLIT_MIN_PREFIX else 1
