"""The token counts prefill CUDA graphs are captured at: close enough that a pass pads little."""

from __future__ import annotations

import pytest

from pdserve.core.prefill_graphs import PREFILL_GRAPH_TOKENS, graph_token_sizes


def test_sizes_run_up_to_the_first_that_holds_the_budget() -> None:
    assert graph_token_sizes(4096)[-1] == 4096
    assert graph_token_sizes(2100) == tuple(s for s in PREFILL_GRAPH_TOKENS if s <= 2112)
    assert graph_token_sizes(100) == (16, 32, 64, 128)
    assert graph_token_sizes(10**6) == PREFILL_GRAPH_TOKENS  # NOTE: passes beyond 4096 tokens run eagerly


@pytest.mark.parametrize("num_tokens", [385, 513, 1100, 1537, 2047, 2049, 2100, 3073, 3100, 4000, 4001])
def test_a_pass_pads_by_less_than_a_step(num_tokens: int) -> None:
    size = next(s for s in PREFILL_GRAPH_TOKENS if s >= num_tokens)
    assert size - num_tokens < (128 if num_tokens <= 512 else 64 if num_tokens <= 2048 else 32)
    assert num_tokens <= 2048 or (size - num_tokens) / num_tokens < 0.016
