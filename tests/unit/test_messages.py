"""core.messages: a step's TokenEvents travel as one TokenBatchEvent frame; bad batches are refused."""

from __future__ import annotations

import msgpack
import pytest

from core.messages import PROTOCOL_VERSION, MessageError, Timings, TokenBatchEvent, TokenEvent, decode, encode


def test_a_token_batch_round_trips_with_nested_timings() -> None:
    batch = TokenBatchEvent(
        [TokenEvent("a", 0, [5], None, 3, 1, Timings(arrival=1.5)), TokenEvent("b", 7, [8, 9], "stop", 4, 0, None)]
    )
    assert decode(encode(batch)) == batch


@pytest.mark.parametrize("events", [[1, 2], "x", [{"request_id": "a", "index": 0, "token_ids": [], "bogus": 1}]])
def test_a_malformed_token_batch_is_a_message_error(events: object) -> None:
    frame = msgpack.packb([PROTOCOL_VERSION, TokenBatchEvent.TAG, {"events": events}], use_bin_type=True)
    with pytest.raises(MessageError):
        decode(frame)
