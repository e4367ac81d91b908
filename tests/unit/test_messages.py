"""core.messages: a step's TokenEvents travel as one TokenBatchEvent frame; bad batches are refused; token ids
travel as packed int32s."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from pdserve.core.messages import (
    PROTOCOL_VERSION,
    GenerateCmd,
    HandoffCmd,
    KvSnapshotCmd,
    MessageError,
    Sampling,
    Timings,
    TokenBatchEvent,
    TokenEvent,
    decode,
    encode,
    pack_block_hashes,
    pack_token_ids,
    unpack_block_hashes,
    unpack_token_ids,
)


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


def test_token_ids_travel_as_packed_int32s() -> None:
    ids = [0, 1, 49151, 128255, 2**31 - 1]
    cmd = GenerateCmd("r", pack_token_ids(ids), Sampling(), 0)
    back = decode(encode(cmd))
    assert isinstance(back, GenerateCmd) and type(back.token_ids) is bytes
    unpacked = unpack_token_ids(back.token_ids)
    assert unpacked is not None and unpacked.dtype == np.int32 and unpacked.tolist() == ids
    assert unpack_token_ids(pack_token_ids([])) is not None and len(pack_token_ids([])) == 0


@pytest.mark.parametrize("raw", [[1, 2], "abcd", b"\x01\x02\x03", None, bytearray(4)])
def test_anything_but_whole_int32_bytes_is_not_token_ids(raw: object) -> None:
    assert unpack_token_ids(raw) is None


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16])
def test_an_integer_array_packs_like_its_list(dtype: type) -> None:
    ids = [0, 1, 49151, 7, 65535]
    assert pack_token_ids(np.array(ids, dtype=dtype)) == pack_token_ids(ids)
    assert pack_token_ids(np.array(ids, dtype=np.int64)[::2]) == pack_token_ids(ids[::2])  # a strided view too


@pytest.mark.parametrize(
    "ids",
    [[2**31], [1, 2.5], ["7"], np.array([1, 2**31]), np.array([-(2**31) - 1]), np.array([1.0, 2.0]), np.array(["7"])],
)
def test_ids_that_are_not_int32_integers_do_not_pack(ids: object) -> None:
    with pytest.raises((OverflowError, TypeError)):
        pack_token_ids(ids)  # type: ignore[arg-type]


def handoff(**fields: object) -> HandoffCmd:
    base: dict[str, object] = dict(
        request_id="r", prefill_worker=0, pool_id="p", lease_id=1, block_ids=[3, 4], token_ids=pack_token_ids([1] * 40),
        num_prompt_tokens=39, num_cached_tokens=0, sampling=Sampling(), timings=Timings(),
    )  # fmt: skip
    return HandoffCmd(**(base | fields))  # type: ignore[arg-type]


def test_block_hashes_travel_as_packed_uint64s() -> None:
    hashes = [0, 1, 2**63, 2**64 - 1, 0x9E37_79B9_7F4A_7C15]
    back = decode(encode(handoff(block_hashes=pack_block_hashes(hashes))))
    assert isinstance(back, HandoffCmd) and unpack_block_hashes(back.block_hashes) == hashes
    assert unpack_block_hashes(b"") == []
    with pytest.raises(OverflowError):
        pack_block_hashes([2**64])


def test_a_handoff_without_block_hashes_decodes_with_none_to_match() -> None:
    fields = {k: v for k, v in msgpack.unpackb(encode(handoff()), raw=False)[2].items() if k != "block_hashes"}
    frame = msgpack.packb([PROTOCOL_VERSION, HandoffCmd.TAG, fields], use_bin_type=True)
    back = decode(frame)
    assert isinstance(back, HandoffCmd) and unpack_block_hashes(back.block_hashes) == []


@pytest.mark.parametrize("raw", [[1, 2], "abcdefgh", b"\x01" * 7, None, bytearray(8)])
def test_anything_but_whole_uint64_bytes_is_not_block_hashes(raw: object) -> None:
    assert unpack_block_hashes(raw) is None


def test_the_owning_front_end_travels_with_a_request_and_a_snapshot_ask() -> None:
    cmd = GenerateCmd("a", pack_token_ids([1, 2]), Sampling(), 0, Timings(), frontend=3)
    handoff = HandoffCmd("a", 0, "pool", 1, [1], pack_token_ids([1, 2]), 1, 0, Sampling(), Timings(), frontend=2)
    for msg in (cmd, handoff, KvSnapshotCmd(frontend=1)):
        assert decode(encode(msg)) == msg
    assert decode(encode(GenerateCmd("a", b"", Sampling(), 0))).frontend == 0  # type: ignore[union-attr]


def test_a_frame_of_the_protocol_before_front_ends_is_refused() -> None:
    frame = msgpack.packb([2, KvSnapshotCmd.TAG, {}], use_bin_type=True)
    with pytest.raises(MessageError, match="protocol version 2"):
        decode(frame)
