"""Bad input end to end: a real cluster (router + 1 prefill + 1 decode on CPU) refuses every malformed
GenerateRequest sent over gRPC with INVALID_ARGUMENT and a message naming the problem, and a hypothesis fuzz of
GenerateRequest finds no request that gets any other refusal, crashes a process or leaks a KV block.

NOTE: the tiny llama has vocab 1024 and a context of 512 tokens, and no chat template. The server defines no
RESOURCE_EXHAUSTED refusal a client can reach here (a prompt too big for the KV pool is INVALID_ARGUMENT, and
256 blocks hold more than the context), so the table has no such case; the fuzz still accepts that code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import text_format
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import greedy_request, wait_blocks_returned
from tests.models import TINY_LLAMA_VOCAB_SIZE
from tests.reliability.report import record

WORKER_FLAGS = ("--num-blocks", "256")
CONTEXT = 512
"""The tiny llama's max_position_embeddings."""
PROMPT_BYTES = 32 * CONTEXT
"""The router's limit on a text or chat prompt's UTF-8 bytes (router/limits.py)."""
INT32 = (-(2**31), 2**31 - 1)
UINT64_MAX = 2**64 - 1
CALL_TIMEOUT_S = 30.0
REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
FINISHED = (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
TABLE_SCENARIO = "bad inputs (table)"
FUZZ_SCENARIO = "GenerateRequest fuzz (hypothesis)"
TABLE_OUTCOMES: dict[str, str | None] = {}
"""Table case id -> None when refused as expected, else what happened (read by the summary test)."""


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running(tiny_llama_dir, tmp_path_factory.mktemp("run"), 1, 1, *WORKER_FLAGS) as c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster: Cluster) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(cluster.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def ids(*token_ids: int, **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=token_ids), sampling=pb.SamplingParams(**sampling))


def chat(*messages: tuple[str, str]) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]))


BAD = [
    ("no-input", pb.GenerateRequest(), "empty"),
    ("empty-text", pb.GenerateRequest(text=""), "empty"),
    ("empty-token-ids", ids(), "empty"),
    ("empty-chat", chat(), "empty"),
    ("chat-without-template", chat(("user", "hi")), "chat template"),
    ("prompt-fills-context", ids(*[1] * CONTEXT), "context"),
    ("text-over-context", pb.GenerateRequest(text="pdserve " * CONTEXT), "context"),
    ("token-id-negative", ids(1, -1), "vocabulary"),
    ("token-id-past-vocab", ids(1, TINY_LLAMA_VOCAB_SIZE), "vocabulary"),
    ("token-id-int32-max", ids(INT32[1], 1), "vocabulary"),
    ("max-tokens-0", ids(1, max_tokens=0), "max_tokens"),
    ("max-tokens-int32-min", ids(1, max_tokens=INT32[0]), "max_tokens"),
    ("temperature-negative", ids(1, temperature=-0.5), "temperature"),
    ("temperature-nan", ids(1, temperature=float("nan")), "temperature"),
    ("temperature-inf", ids(1, temperature=float("inf")), "temperature"),
    ("temperature-float32-overflow", ids(1, temperature=1e39), "temperature"),
    ("top-p-0", ids(1, top_p=0.0), "top_p"),
    ("top-p-above-1", ids(1, top_p=1.5), "top_p"),
    ("top-p-nan", ids(1, top_p=float("nan")), "top_p"),
    ("top-p-minus-inf", ids(1, top_p=float("-inf")), "top_p"),
    ("top-k-negative", ids(1, top_k=-1), "top_k"),
    ("top-k-int32-min", ids(1, top_k=INT32[0]), "top_k"),
    ("min-tokens-above-max", ids(1, max_tokens=4, min_tokens=5), "min_tokens"),
    ("min-tokens-negative", ids(1, min_tokens=-1), "min_tokens"),
    ("seed-2-pow-63", ids(1, seed=2**63), "seed"),
    ("seed-uint64-max", ids(1, seed=UINT64_MAX), "seed"),
    ("stop-token-past-vocab", ids(1, stop_token_ids=[TINY_LLAMA_VOCAB_SIZE]), "stop token"),
    ("stop-token-negative", ids(1, stop_token_ids=[2, -7]), "stop token"),
    ("empty-stop-string", ids(1, stop=["ok", ""]), "stop strings"),
    ("request-id-too-long", pb.GenerateRequest(text="hi", request_id="x" * 257), "request_id"),
    ("request-id-too-long-multibyte", pb.GenerateRequest(text="hi", request_id="é" * 257), "request_id"),
    # the limits (router/limits.py): each message names the limit
    ("request-id-over-256-bytes", pb.GenerateRequest(text="hi", request_id="é" * 129),
     "request_id: 258 bytes, over the limit of 256"),
    ("max-tokens-past-context", ids(1, 2, max_tokens=CONTEXT - 1),
     f"prompt (2 tokens) + max_tokens ({CONTEXT - 1}) exceeds the model's context length ({CONTEXT})"),
    ("max-tokens-int32-max", ids(1, max_tokens=INT32[1]), f"exceeds the model's context length ({CONTEXT})"),
    ("token-ids-far-past-context", ids(*[1] * 100_000), f"context length ({CONTEXT})"),
    ("stop-strings-17", ids(1, stop=["x"] * 17), "stop: 17 strings, over the limit of 16"),
    ("stop-bytes-4097", ids(1, stop=["x" * 4000, "y" * 97]), "stop: 4097 bytes in all, over the limit of 4096"),
    ("stop-token-ids-1025", ids(1, stop_token_ids=[2] * 1025), "stop_token_ids: 1025 ids, over the limit of 1024"),
    ("chat-messages-1025", chat(*[("user", "hi")] * 1025), "chat: 1025 messages, over the limit of 1024"),
    ("chat-bytes", chat(("user", "x" * PROMPT_BYTES)), f"over the limit of {PROMPT_BYTES} (32 bytes per token"),
    ("text-bytes", pb.GenerateRequest(text="x" * (PROMPT_BYTES + 1)),
     f"text: {PROMPT_BYTES + 1} bytes, over the limit of {PROMPT_BYTES}"),
]  # fmt: skip


def refusal(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest, needle: str) -> str | None:
    """None when req is refused with INVALID_ARGUMENT and a message containing needle; else what happened."""
    try:
        responses = list(stub.Generate(req, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.INVALID_ARGUMENT and needle in details.lower():
            return None
        return f"{code.name}: {details!r}"
    return f"served {len(responses)} responses instead of refusing"


def outcome(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest) -> str:
    """How req ended: streamed to a normal finish ("finished"), refused with a REFUSED code and a message
    ("refused"), or anything else, described."""
    try:
        responses = list(stub.Generate(req, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        return "refused" if code in REFUSED and details.strip() else f"{code.name}: {details!r}"
    if not responses or responses[-1].finish_reason not in FINISHED:
        return f"stream of {len(responses)} responses ended without a finish reason"
    return "finished"


def restarts(cluster: Cluster) -> dict[str, int]:
    return {role["name"]: int(role["restarts"]) for role in cluster.status()["roles"]}


def leaked_blocks(cluster: Cluster) -> int:
    """KV blocks still held once the pools had a few seconds to get every block back (0 when all came back)."""
    with contextlib.suppress(AssertionError):
        wait_blocks_returned(cluster)
    stats = [cluster.stats("prefill", 0), cluster.stats("decode", 0)]
    return sum(s["num_total_blocks"] - s["num_free_blocks"] for s in stats)


def serves(stub: pb_grpc.GenerationStub) -> bool:
    responses = list(stub.Generate(greedy_request([4, 5, 6], max_tokens=3), timeout=CALL_TIMEOUT_S))
    return sum(len(r.token_ids) for r in responses) == 3 and responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize(("request_", "needle"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_is_invalid_argument_with_a_message(
    request: pytest.FixtureRequest, stub: pb_grpc.GenerationStub, request_: pb.GenerateRequest, needle: str
) -> None:
    case = request.node.callspec.id
    TABLE_OUTCOMES[case] = refusal(stub, request_, needle)
    assert TABLE_OUTCOMES[case] is None, TABLE_OUTCOMES[case]


def test_bad_requests_leave_the_cluster_serving_with_every_block_back(
    cluster: Cluster, stub: pb_grpc.GenerationStub
) -> None:
    failures = sum(o is not None for o in TABLE_OUTCOMES.values())
    leaked = leaked_blocks(cluster)
    record(TABLE_SCENARIO, len(TABLE_OUTCOMES), failures, leaked, None)
    assert len(TABLE_OUTCOMES) == len(BAD) >= 41
    assert failures == 0, {case: o for case, o in TABLE_OUTCOMES.items() if o is not None}
    assert leaked == 0
    assert serves(stub)
    assert set(restarts(cluster).values()) == {0}


# --- the fuzz ---------------------------------------------------------------------------------------------------

UNICODE = st.characters(codec="utf-8")
"""Any code point but the surrogates (protobuf strings are UTF-8)."""
TEXT = st.text(UNICODE, max_size=200)
INT32S = st.integers(*INT32)
TOKEN_ID = st.integers(0, TINY_LLAMA_VOCAB_SIZE - 1) | INT32S
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    """Any GenerateRequest the proto types allow (stop lists and max_tokens past their limits too), except that a
    valid max_tokens stays <= 4 when set (the run stays fast)."""
    req = pb.GenerateRequest(request_id=draw(st.text(UNICODE, max_size=300)))
    kind = draw(st.sampled_from(["text", "token_ids", "long_token_ids", "chat", "none"]))
    if kind == "text":
        req.text = draw(TEXT)
    elif kind == "token_ids":
        req.token_ids.ids.extend(draw(st.lists(TOKEN_ID, max_size=40)))
    elif kind == "long_token_ids":
        req.token_ids.ids.extend([1] * draw(st.integers(CONTEXT - 4, CONTEXT + 4)))
    elif kind == "chat":
        messages = draw(st.lists(st.tuples(TEXT, TEXT), max_size=3))
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
    fields = {
        "temperature": st.sampled_from([0.0, 0.7]) | FLOAT32,
        "top_k": st.integers(0, 50) | INT32S,
        "top_p": st.floats(0.05, 1.0) | FLOAT32,
        "seed": st.integers(0, UINT64_MAX),
        "max_tokens": st.integers(1, 4) | st.integers(INT32[0], 0) | st.integers(CONTEXT, INT32[1]),
        "min_tokens": st.integers(0, 4) | INT32S,
    }
    for name, strategy in fields.items():
        if draw(st.booleans()):
            setattr(req.sampling, name, draw(strategy))
    if not req.sampling.HasField("max_tokens") and draw(st.booleans()):
        req.sampling.max_tokens = 1  # NOTE: unset max_tokens (the rest of the context) stays possible, but rarer
    req.sampling.stop.extend(draw(st.lists(st.text(UNICODE, max_size=5), max_size=3) | st.just(["x"] * 17)))
    req.sampling.stop_token_ids.extend(draw(st.lists(TOKEN_ID, max_size=3) | st.just([2] * 1025)))
    req.sampling.ignore_eos = draw(st.booleans())
    return req


def test_fuzzed_requests_finish_or_are_refused_and_nothing_crashes(
    cluster: Cluster, stub: pb_grpc.GenerationStub
) -> None:
    before = restarts(cluster)
    outcomes: list[tuple[pb.GenerateRequest, str]] = []

    valid = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(max_tokens=2))

    # NOTE: derandomized, so CI sees the same 60 requests each run; the two examples pin both outcomes
    @settings(max_examples=60, deadline=None, database=None, derandomize=True)
    @given(generate_requests())
    @example(valid)
    @example(pb.GenerateRequest())
    def one(req: pb.GenerateRequest) -> None:
        outcomes.append((req, outcome(stub, req)))

    one()
    bad = [
        f"{what} <- {text_format.MessageToString(req, as_one_line=True)[:300]}"
        for req, what in outcomes
        if what not in ("finished", "refused")
    ]
    leaked = leaked_blocks(cluster)
    record(FUZZ_SCENARIO, len(outcomes), len(bad), leaked, None)
    assert not bad, "\n".join(bad)
    assert {"finished", "refused"} <= {what for _, what in outcomes}  # the fuzz reached both ends
    assert leaked == 0
    assert serves(stub)
    assert restarts(cluster) == before
