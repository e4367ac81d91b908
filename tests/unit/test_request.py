"""Request's id views: the array beside the list."""

from __future__ import annotations

import numpy as np

from pdserve.core.messages import pack_token_ids
from pdserve.core.request import Request
from pdserve.core.sampler import SamplingState
from pdserve.core.sampling_params import SamplingParams


def make(ids: list[int], with_array: bool = True) -> Request:
    array = np.asarray(ids, dtype=np.int64) if with_array else np.zeros(0, dtype=np.int64)
    return Request("r", list(ids), len(ids), SamplingState(SamplingParams(), ()), token_array=array)


def test_id_array_is_the_prompt_array_then_the_generated_ids() -> None:
    prompt = [7, 128000, 3, 99_999]
    req = make(prompt)
    assert req.id_array() is req.token_array
    req.token_ids += [5, 6]
    got = req.id_array()
    assert got.dtype == np.int64 and got.tolist() == [*prompt, 5, 6]
    assert pack_token_ids(got) == pack_token_ids(req.token_ids)


def test_id_array_of_a_request_without_an_array_is_its_list() -> None:
    req = make([1, 2, 3], with_array=False)
    assert req.id_array().tolist() == [1, 2, 3]


def test_tokens_view_the_array_and_read_the_list_past_it() -> None:
    """A handoff's request: all but its last id in the array."""
    ids = [4, 8, 15, 16, 23, 42]
    req = Request("r", list(ids), 6, SamplingState(SamplingParams(), ()), token_array=np.asarray(ids[:-1]))
    assert req.tokens(0, 5).tolist() == ids[:5]  # type: ignore[union-attr]
    req.token_ids.append(7)
    assert req.tokens(3, 7) == [16, 23, 42, 7]
    assert req.id_array().tolist() == [*ids, 7]
