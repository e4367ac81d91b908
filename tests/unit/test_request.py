"""Request's id views: the array beside the list, and the list a long prompt gets after its first pass."""

from __future__ import annotations

import numpy as np

from pdserve.core.messages import pack_token_ids
from pdserve.core.request import Request
from pdserve.core.sampler import SamplingState
from pdserve.core.sampling_params import SamplingParams


def make(ids: list[int], with_array: bool = True, pending: bool = False) -> Request:
    array = np.asarray(ids, dtype=np.int64) if with_array else np.zeros(0, dtype=np.int64)
    listed = [0] * len(ids) if pending else list(ids)
    return Request("r", listed, len(ids), SamplingState(SamplingParams(), ()), token_array=array, ids_pending=pending)


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


def test_fill_ids_writes_the_prompt_once() -> None:
    prompt = [4, 8, 15, 16, 23, 42]
    req = make(prompt, pending=True)
    assert req.token_ids == [0] * 6 and req.tokens(0, 6).tolist() == prompt  # type: ignore[union-attr]
    req.fill_ids()
    assert req.token_ids == prompt and not req.ids_pending
    req.token_ids.append(9)
    req.fill_ids()  # a no-op now: the generated id stays
    assert req.token_ids == [*prompt, 9]


def test_tokens_past_the_array_of_a_pending_list_fill_it_first() -> None:
    """A handoff's request: all but its last id in the array, the list zeros but for that id until filled."""
    ids = [4, 8, 15, 16, 23, 42]
    req = Request(
        "r", [0] * 5 + [42], 6, SamplingState(SamplingParams(), ()),
        token_array=np.asarray(ids[:-1], dtype=np.int64), ids_pending=True,
    )  # fmt: skip
    assert req.tokens(0, 5).tolist() == ids[:5] and req.ids_pending  # type: ignore[union-attr]
    req.token_ids.append(7)
    assert req.tokens(3, 7) == [16, 23, 42, 7] and not req.ids_pending
    assert req.id_array().tolist() == [*ids, 7]
