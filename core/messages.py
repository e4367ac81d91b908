"""Messages between the router and the worker processes: msgpack over ZeroMQ, one schema module.

Wire format of every message: one ZMQ frame holding msgpack [PROTOCOL_VERSION, type tag, {field: value}].
`*Cmd` asks a process to do something; `*Event` reports that something happened. Decoding checks the
version, the tag, the field names and a size limit, and raises MessageError for anything else, so a
worker can log and drop a hostile frame and keep serving.

This module must not import torch: the router imports it.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

from pdserve.core.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

PROTOCOL_VERSION = 3
MAX_MESSAGE_BYTES = 64 << 20
"""Largest frame any socket accepts (a 1M-token prompt is ~5 MB of msgpack)."""


class MessageError(ValueError):
    """A frame that is not a valid message of this protocol version."""


TokenIds = Sequence[int] | np.ndarray
"""Token ids as a list or a [num_tokens] integer array (what the router and the workers hold)."""

INT32 = np.iinfo(np.int32)


def pack_token_ids(ids: TokenIds) -> bytes:
    """Token ids as they travel (GenerateCmd, HandoffCmd): int32 little-endian bytes, a msgpack bin.

    Bytes rather than a msgpack list of ints: they pack and unpack into an array without a per-element step or
    the receiver's per-element type check. Raises OverflowError / TypeError for ids that are not int32 integers."""
    if isinstance(ids, np.ndarray):
        return _pack_array(ids)
    packed = array.array("i", ids)
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        packed.byteswap()
    return packed.tobytes()


def _pack_array(ids: np.ndarray) -> bytes:
    if ids.dtype.kind not in "iu":
        raise TypeError(f"token ids of dtype {ids.dtype}")
    if ids.size and (ids.min() < INT32.min or ids.max() > INT32.max):
        raise OverflowError("token id outside int32")
    return ids.astype("<i4", copy=False).tobytes()


def pack_block_hashes(hashes: Sequence[int]) -> bytes:
    """Block hashes as they travel (HandoffCmd): uint64 little-endian bytes. OverflowError for a hash that is
    not an unsigned 64-bit int."""
    packed = array.array("Q", hashes)
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        packed.byteswap()
    return packed.tobytes()


def unpack_block_hashes(raw: object) -> list[int] | None:
    """pack_block_hashes' inverse; None unless raw is bytes holding whole uint64s."""
    if type(raw) is not bytes or len(raw) % 8:
        return None
    packed = array.array("Q")
    packed.frombytes(raw)
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tolist()


def unpack_token_ids(raw: object) -> np.ndarray | None:  # [num_tokens] int32, read-only; None: not token ids
    """pack_token_ids' inverse; None unless raw is bytes holding whole int32s."""
    if type(raw) is not bytes or len(raw) % 4:
        return None
    return np.frombuffer(raw, dtype="<i4")


@dataclass(frozen=True)
class Sampling(SamplingParams):
    """The wire form of a request's sampling: every SamplingParams field, plus its progress."""

    num_generated: int = 0
    """New tokens the request already has (a handed-off request's first token, a resumed request's output)."""

    @classmethod
    def of(cls, params: SamplingParams, num_generated: int = 0) -> Sampling:
        return cls(**_params_fields(params), num_generated=num_generated)

    @property
    def params(self) -> SamplingParams:
        """The engine's SamplingParams (progress dropped)."""
        return SamplingParams(**_params_fields(self))


def _params_fields(params: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams)}


@dataclass(frozen=True)
class Timings:
    """Server-side times of one request, seconds since the epoch (0.0 = not reached)."""

    arrival: float = 0.0
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    handoff_end: float = 0.0
    first_token: float = 0.0


@dataclass(frozen=True)
class GenerateCmd:
    """Router -> prefill worker: prefill this prompt, then hand it to decode_worker."""

    TAG: ClassVar[str] = "generate"
    request_id: str
    token_ids: bytes
    """The prompt, pack_token_ids."""
    sampling: Sampling
    decode_worker: int
    timings: Timings = field(default_factory=Timings)
    frontend: int = 0
    """The router process (front end) that owns the request: its TokenEvents and RequestErrorEvents go there."""


@dataclass(frozen=True)
class AbortCmd:
    """Router -> workers: stop this request and free what it holds."""

    TAG: ClassVar[str] = "abort"
    request_id: str


@dataclass(frozen=True)
class HandoffCmd:
    """Prefill -> decode worker: the prompt's KV sits in these blocks of prefill_worker's pool (leased
    until ReleaseCmd); first_token was already sampled and streamed."""

    TAG: ClassVar[str] = "handoff"
    request_id: str
    prefill_worker: int
    pool_id: str
    """Identity of the prefill worker's KV pool (changes on restart): a stale handshake is redone."""
    lease_id: int
    block_ids: list[int]
    token_ids: bytes
    """Prompt followed by the first token (pack_token_ids); the KV of all but the last token is in block_ids."""
    num_prompt_tokens: int
    num_cached_tokens: int
    sampling: Sampling
    timings: Timings
    block_hashes: bytes = b""
    """Chained hashes (core.block_pool) of the full blocks whose KV block_ids hold, uint64 little-endian
    (pack_block_hashes); empty from a prefill worker without a prefix cache. The decode worker matches its cache
    with them and registers them instead of hashing the prompt again in its decode loop."""
    frontend: int = 0
    """GenerateCmd.frontend: where the decode worker sends the request's tokens."""


@dataclass(frozen=True)
class ReleaseCmd:
    """Decode -> prefill worker: these leases' blocks are copied (or no longer wanted); free them."""

    TAG: ClassVar[str] = "release"
    decode_worker: int
    lease_ids: list[int]
    pool_id: str
    """The pool the leases are of (HandoffCmd.pool_id): a restarted prefill worker's lease ids start over."""


@dataclass(frozen=True)
class DecodeWorkerLostCmd:
    """Router -> prefill workers: decode_worker died; reclaim every lease it held."""

    TAG: ClassVar[str] = "decode_lost"
    decode_worker: int


TokenLogprob = tuple[float, list[int], list[float]]
"""One generated token's log-probability, then the ids and log-probabilities of the most likely tokens at its
position, most likely first (as many as the request's top_logprobs). msgpack sends it as a list."""


@dataclass(frozen=True)
class TokenEvent:
    """Worker -> router: new tokens of a request. index is the position of token_ids[0] among the
    request's generated tokens, so the router can order events from the prefill and decode workers."""

    TAG: ClassVar[str] = "tokens"
    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    timings: Timings | None = None
    logprobs: list[TokenLogprob] | None = None
    """One per token of token_ids, for requests that asked (Sampling.logprobs); None otherwise."""


@dataclass(frozen=True)
class TokenBatchEvent:
    """Worker -> router: the TokenEvents of one engine step in one frame (a busy decode worker emits one per
    running request per step; one frame each would make the router's receive loop the bottleneck)."""

    TAG: ClassVar[str] = "token_batch"
    events: list[TokenEvent]


@dataclass(frozen=True)
class RequestErrorEvent:
    """Worker -> router: the request failed; code is a gRPC status name (INVALID_ARGUMENT, ...)."""

    TAG: ClassVar[str] = "request_error"
    request_id: str
    code: str
    message: str


@dataclass(frozen=True)
class HeartbeatEvent:
    """Worker -> router, periodically and at start: who it is and how loaded it is."""

    TAG: ClassVar[str] = "heartbeat"
    role: str
    worker_id: int
    pid: int
    incarnation: str
    """Random per process start: a restart is a new incarnation."""
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    counters: dict[str, int] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)
    """The worker's KV layout fingerprint (kvtransfer/layout.py): the router serves with one layout only."""
    ranks: list[int] = field(default_factory=list)
    """Pids of the worker's TP group in rank order (pid is ranks[0]; [] from a worker of TP size 1)."""


@dataclass(frozen=True)
class HandshakeCmd:
    """Decode -> prefill worker (REQ/REP): open the KV pool, if our layouts agree."""

    TAG: ClassVar[str] = "handshake"
    decode_worker: int
    fingerprint: dict[str, Any]


@dataclass(frozen=True)
class HandshakeEvent:
    """Prefill -> decode worker: the transport descriptor, or why the layouts disagree."""

    TAG: ClassVar[str] = "handshake_reply"
    ok: bool
    error: str = ""
    pool_id: str = ""
    descriptor: dict[str, Any] = field(default_factory=dict)


KV_REMOVED = 0
"""KvEventBatchEvent.events kind: the hash left the worker's prefix cache."""
KV_STORED = 1
"""KvEventBatchEvent.events kind: the hash entered the worker's prefix cache."""


@dataclass(frozen=True)
class KvEventBatchEvent:
    """Worker -> router (PUB, may be lost): the prefix-cache changes of one loop iteration of one worker.

    `seq` is 1 for an incarnation's first batch and grows by 1 per batch; by 2 when the pool dropped
    events, so that a missing seq always means the router's copy is stale and must be resynced.
    """

    TAG: ClassVar[str] = "kv_batch"
    role: str
    worker_id: int
    incarnation: str
    seq: int
    block_size: int
    events: list[tuple[int, int]]
    """(kind, block_hash) in the order they happened, kind KV_STORED or KV_REMOVED: one step may remove a hash
    and store it again, so the order matters."""


@dataclass(frozen=True)
class KvSnapshotCmd:
    """Router -> worker (its inbox): send a KvSnapshotEvent to front end `frontend`."""

    TAG: ClassVar[str] = "kv_snapshot_cmd"
    frontend: int = 0


@dataclass(frozen=True)
class KvSnapshotEvent:
    """Worker -> router (its inbox): the whole prefix cache, as it is after batch seq (0: before any)."""

    TAG: ClassVar[str] = "kv_snapshot"
    role: str
    worker_id: int
    incarnation: str
    seq: int
    block_size: int
    hashes: list[int]
    """Every hash cached; ~9 bytes each on the wire, so MAX_MESSAGE_BYTES holds ~7M blocks."""


@dataclass(frozen=True)
class RankPassCmd:
    """Rank 0 -> the other ranks of its worker's TP group: run the general (prefill or mixed) pass rank 0 runs
    now, on the same inputs (core/rank_pass.py)."""

    TAG: ClassVar[str] = "rank_pass"
    copies: list[list[int]]
    """[source ids, destination ids] of the block copies (copy-on-write) before the pass, or []."""
    arrays: list[bytes]
    """The pass's host inputs (core/prefill_graphs.py HostInputs), each array's bytes in field order."""
    num_seqs: int


@dataclass(frozen=True)
class RankDecodeCmd:
    """Rank 0 -> the other ranks of its TP group: run the decode pass whose rows rank 0 staged
    (core/decode_batch.py)."""

    TAG: ClassVar[str] = "rank_decode"
    copies: list[list[int]]
    num_seqs: int
    ids_pos: bytes
    """[3, padded] int64: token ids, positions, rows of the sampled tokens."""
    seq_lens: bytes
    """[padded] int32."""
    table_changes: list[list[int]]
    """[row, start, *block ids from start] of each block-table row rank 0 rewrote."""
    gathers: bool
    """Rows take their token from the last step's sampled tokens (broadcast by rank 0)."""


@dataclass(frozen=True)
class RankPullCmd:
    """Rank 0 of a decode group -> its other ranks: pull your KV heads of these blocks (ids of the prefill
    worker's pool and of ours; our pools share one block table)."""

    TAG: ClassVar[str] = "rank_pull"
    pull_id: int
    prefill_worker: int
    src_block_ids: list[int]
    dst_block_ids: list[int]


@dataclass(frozen=True)
class RankOpenCmd:
    """Rank 0 of a decode group -> its other ranks: open this prefill worker's pool (a handshake's descriptor)."""

    TAG: ClassVar[str] = "rank_open"
    prefill_worker: int
    descriptor: dict[str, Any]


@dataclass(frozen=True)
class RankStopCmd:
    """Rank 0 -> its other ranks: the worker stops; leave the group and exit."""

    TAG: ClassVar[str] = "rank_stop"


@dataclass(frozen=True)
class RankReadyEvent:
    """A rank > 0 -> rank 0, once: loaded, warmed up, serving; the descriptors of its KV pool (prefill)."""

    TAG: ClassVar[str] = "rank_ready"
    tp_rank: int
    pid: int
    descriptors: dict[str, Any] = field(default_factory=dict)
    """transport -> this rank's source descriptor (kvtransfer.base), or why it cannot open ({"error": ...})."""


@dataclass(frozen=True)
class RankPullDoneEvent:
    """A decode rank > 0 -> rank 0: these pulls' copies have finished on this rank."""

    TAG: ClassVar[str] = "rank_pull_done"
    tp_rank: int
    pull_ids: list[int]


Message = (
    GenerateCmd
    | AbortCmd
    | HandoffCmd
    | ReleaseCmd
    | DecodeWorkerLostCmd
    | TokenEvent
    | TokenBatchEvent
    | RequestErrorEvent
    | HeartbeatEvent
    | HandshakeCmd
    | HandshakeEvent
    | KvEventBatchEvent
    | KvSnapshotCmd
    | KvSnapshotEvent
    | RankPassCmd
    | RankDecodeCmd
    | RankPullCmd
    | RankOpenCmd
    | RankStopCmd
    | RankReadyEvent
    | RankPullDoneEvent
)
_TYPES: dict[str, type] = {
    t.TAG: t
    for t in (
        GenerateCmd,
        AbortCmd,
        HandoffCmd,
        ReleaseCmd,
        DecodeWorkerLostCmd,
        TokenEvent,
        TokenBatchEvent,
        RequestErrorEvent,
        HeartbeatEvent,
        HandshakeCmd,
        HandshakeEvent,
        KvEventBatchEvent,
        KvSnapshotCmd,
        KvSnapshotEvent,
        RankPassCmd,
        RankDecodeCmd,
        RankPullCmd,
        RankOpenCmd,
        RankStopCmd,
        RankReadyEvent,
        RankPullDoneEvent,
    )
}
_NESTED = {"sampling": Sampling, "timings": Timings}
_DATACLASS_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in (*_TYPES.values(), Sampling, Timings)
}
"""Field names of every message and nested dataclass (encode's fast path)."""


def encode(msg: Message) -> bytes:
    """One frame: msgpack [version, tag, fields]."""
    return msgpack.packb([PROTOCOL_VERSION, msg.TAG, _plain(msg)], use_bin_type=True)


def _plain(value: Any) -> Any:
    """Dataclasses (nested too, and lists of them) as dicts; everything else as it is. Not
    dataclasses.asdict, which deep-copies every list element by element; lists of ints go to msgpack as they
    are."""
    names = _DATACLASS_FIELDS.get(type(value))
    if names is not None:
        return {name: _plain(getattr(value, name)) for name in names}
    if type(value) is list and value and type(value[0]) in _DATACLASS_FIELDS:
        return [_plain(v) for v in value]
    return value


def decode(frame: bytes) -> Message:
    """Parse one frame; MessageError on anything that is not a valid message."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise MessageError(f"frame of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MessageError(f"not msgpack: {exc}") from None
    if not (isinstance(obj, list) and len(obj) == 3 and isinstance(obj[2], dict)):
        raise MessageError("frame is not [version, type, fields]")
    version, tag, fields = obj
    if version != PROTOCOL_VERSION:
        raise MessageError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    cls = _TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {tag!r}")
    msg = _build(cls, fields)
    if isinstance(msg, (KvEventBatchEvent, KvSnapshotEvent)):
        _check_kv(msg)
    return msg  # type: ignore[no-any-return]


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _build(cls: type, fields: dict[str, Any]) -> Any:
    unknown = fields.keys() - _field_names(cls)
    if unknown:
        raise MessageError(f"{cls.__name__}: unknown fields {sorted(map(str, unknown))}")
    kwargs = {}
    for name, value in fields.items():
        nested = _NESTED.get(name)
        if nested is not None and isinstance(value, dict):
            value = _build(nested, value)
        elif cls is TokenBatchEvent and name == "events":
            value = _build_events(value)
        elif cls is KvEventBatchEvent and name == "events":
            value = _build_kv_events(value)
        elif isinstance(value, list) and name == "stop_token_ids":
            value = tuple(value)
        elif cls is TokenEvent and name == "logprobs" and value is not None:
            value = _build_logprobs(value, fields.get("token_ids"))
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise MessageError(f"{cls.__name__}: {exc}") from None


def _build_events(value: Any) -> list[TokenEvent]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise MessageError("TokenBatchEvent.events must be a list of TokenEvent fields")
    return [_build(TokenEvent, v) for v in value]


def _build_logprobs(value: Any, token_ids: Any) -> list[TokenLogprob]:
    """TokenEvent.logprobs as tuples; MessageError unless one [float, ids, floats] per token (the router builds
    responses from them)."""
    if not (isinstance(value, list) and isinstance(token_ids, list) and len(value) == len(token_ids)):
        raise MessageError("TokenEvent.logprobs must be a list with one entry per token")
    return [_token_logprob(entry) for entry in value]


def _token_logprob(entry: Any) -> TokenLogprob:
    if not (isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is float):
        raise MessageError(f"TokenEvent.logprobs: bad entry {entry!r}")
    ids, logprobs = entry[1], entry[2]
    ok = isinstance(ids, list) and isinstance(logprobs, list) and len(ids) == len(logprobs) <= MAX_TOP_LOGPROBS
    if not (ok and all(type(i) is int and INT32.min <= i <= INT32.max for i in ids)):
        raise MessageError(f"TokenEvent.logprobs: bad top ids {entry!r}")
    if not all(type(v) is float for v in logprobs):
        raise MessageError(f"TokenEvent.logprobs: bad top logprobs {entry!r}")
    return (entry[0], ids, logprobs)


def _is_uint64(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 64


def _build_kv_events(value: Any) -> list[tuple[int, int]]:
    if not isinstance(value, list):
        raise MessageError("KvEventBatchEvent.events must be a list of [kind, hash]")
    events = []
    for event in value:
        ok = isinstance(event, list) and len(event) == 2 and type(event[0]) is int
        if not (ok and event[0] in (KV_REMOVED, KV_STORED)):
            raise MessageError(f"KvEventBatchEvent: bad event {event!r}")
        events.append((event[0], event[1]))
    return events


def _check_kv(msg: KvEventBatchEvent | KvSnapshotEvent) -> None:
    """The router keys and indexes by these fields: refuse anything it could not use."""
    if msg.role not in ("prefill", "decode") or type(msg.worker_id) is not int or not isinstance(msg.incarnation, str):
        raise MessageError(f"{type(msg).__name__}: bad origin {msg.role!r} {msg.worker_id!r} {msg.incarnation!r}")
    if type(msg.seq) is not int or msg.seq < 0 or type(msg.block_size) is not int or msg.block_size <= 0:
        raise MessageError(f"{type(msg).__name__}: bad seq {msg.seq!r} or block_size {msg.block_size!r}")
    if isinstance(msg, KvEventBatchEvent):
        hashes: Any = [h for _, h in msg.events]
    else:
        hashes = msg.hashes
    if not (isinstance(hashes, list) and all(map(_is_uint64, hashes))):
        raise MessageError(f"{type(msg).__name__}: block hashes must be unsigned 64-bit ints")
