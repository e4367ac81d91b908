"""Every call the router accepts ends in exactly one outcome, counted in pdserve_requests_total{outcome} and
logged once at INFO; every request limit (router/limits.py) is refused INVALID_ARGUMENT with a message naming
it. The router runs with fake workers (tests/router_fakes.py)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.core.messages import GenerateCmd
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.router import server
from pdserve.router.outcome import OUTCOMES, CallAccounting
from pdserve.router.validation import RequestValidator
from tests.router_fakes import HEARTBEAT_TIMEOUT, Harness, Script, eventually, router_with_fakes

CONTEXT = 8192
"""SmolLM2's max_position_embeddings."""
NUM_CANCELS = 100
STALLED = Script(list(range(100, 140)), decode_stall_after=2)
"""Streams that never finish: each call ends when its client cancels it."""


def outcomes(h: Harness) -> dict[str, int]:
    """pdserve_requests_total by outcome, those above 0."""
    registry = h.router.metrics.registry
    counts = {o: registry.get_sample_value("pdserve_requests_total", {"outcome": o}) for o in OUTCOMES}
    return {o: int(n) for o, n in counts.items() if n}


def end_lines(caplog: pytest.LogCaptureFixture, prefix: str) -> list[str]:
    """The router's INFO lines that end a call whose request id starts with prefix."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "pdserve.router.request_path" and r.levelno == logging.INFO and r.getMessage().startswith(prefix)
    ]


def ids(*token_ids: int, request_id: str = "", **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=token_ids), sampling=pb.SamplingParams(**sampling), request_id=request_id
    )


def chat(num_messages: int, content: str) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role="user", content=content)] * num_messages
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=messages))


LIMIT_CASES = [
    ("request-id-bytes", ids(1, request_id="é" * 129), "request_id: 258 bytes, over the limit of 256"),
    ("stop-strings", ids(1, stop=["x"] * 17), "stop: 17 strings, over the limit of 16"),
    ("stop-bytes", ids(1, stop=["x" * 2048, "y" * 2049]), "stop: 4097 bytes in all, over the limit of 4096"),
    ("stop-token-ids", ids(1, stop_token_ids=[2] * 1025), "stop_token_ids: 1025 ids, over the limit of 1024"),
    ("chat-messages", chat(1025, "hi"), "chat: 1025 messages, over the limit of 1024"),
    ("chat-bytes", chat(2, "x" * 131069), "chat: 262146 bytes of roles and contents, over the limit of 262144"),
    ("text-bytes", pb.GenerateRequest(text="x" * 262145), "text: 262145 bytes, over the limit of 262144"),
    ("token-ids-fill-context", ids(*[1] * CONTEXT), f"prompt of {CONTEXT} tokens leaves no room"),
    ("max-tokens-over-context", ids(1, 2, max_tokens=CONTEXT - 1),
     f"prompt (2 tokens) + max_tokens ({CONTEXT - 1}) exceeds the model's context length ({CONTEXT})"),
    ("max-tokens-int32-max", ids(1, max_tokens=2**31 - 1), f"max_tokens ({2**31 - 1}) exceeds"),
]  # fmt: skip


def test_every_limit_is_invalid_argument_naming_it(
    smollm2_dir: Path, run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "pdserve.router")

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([5])) as h:
            for case, request, message in LIMIT_CASES:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await h.generate(request)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
                assert message in (err.value.details() or ""), (case, err.value.details())
            assert not h.prefill.got(GenerateCmd)
            assert outcomes(h) == {"invalid": len(LIMIT_CASES)}

    asyncio.run(body())
    assert len(end_lines(caplog, "request ")) == len(LIMIT_CASES)


HOLD = ("x-test-hold", "1")
"""Metadata of a call that HoldingAccounting holds before its handler runs."""


class HoldingAccounting(CallAccounting):
    """CallAccounting, after which a call that carries HOLD waits until cancelled: a call whose request the
    router has not read yet (under load gRPC reads it late; a cancel can land first)."""

    num_held = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        async def hold(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
            if HOLD in tuple(details.invocation_metadata or ()):
                HoldingAccounting.num_held += 1
                await asyncio.Event().wait()
            return await continuation(details)

        return await super().intercept_service(hold, handler_call_details)


async def cancel_all_at_random_moments(h: Harness, rng: random.Random) -> int:
    """NUM_CANCELS calls that each need most of the fake decode worker's KV (63 of 128 blocks): about a fifth
    are held before their handler runs, two stream, the rest queue. Once every call is in the router, each
    is cancelled in random order at random moments, so a cancel finds its call unread, queued or streaming
    (and each cancel of a streaming call admits the next in the queue). The number held."""
    held = [rng.random() < 0.2 for _ in range(NUM_CANCELS)]
    calls = [
        h.stub.Generate(ids(1, 2, max_tokens=1006, request_id=f"cancel-{i}"), metadata=(HOLD,) if hold else None)
        for i, hold in enumerate(held)
    ]
    hub = h.router.hub
    num_held = sum(held)
    await eventually(
        lambda: (
            len(hub.admission) + len(hub.table) == NUM_CANCELS - num_held and HoldingAccounting.num_held == num_held
        ),
        timeout=10.0,
    )
    rng.shuffle(calls)
    for call in calls:
        await asyncio.sleep(rng.uniform(0.0, 0.004))
        call.cancel()
    await eventually(lambda: sum(outcomes(h).values()) == NUM_CANCELS, timeout=10.0)
    return num_held


def test_100_random_cancels_each_end_in_one_counted_outcome(
    smollm2_dir: Path, run_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, "pdserve.router")
    monkeypatch.setattr(server, "CallAccounting", HoldingAccounting)
    monkeypatch.setattr(HoldingAccounting, "num_held", 0)

    async def body() -> tuple[dict[str, int], int]:
        async with router_with_fakes(smollm2_dir, run_dir, STALLED, block_size=16, max_queued=NUM_CANCELS) as h:
            num_held = await cancel_all_at_random_moments(h, random.Random(3))
            await eventually(lambda: len(h.router.hub.table) == 0 and len(h.router.hub.admission) == 0)
            return outcomes(h), num_held

    counts, num_held = asyncio.run(body())
    print(f"outcomes of {NUM_CANCELS} cancels: {counts} ({num_held} before the handler read the request)")
    assert set(counts) == {"cancelled", "cancelled_before_admission"}, counts
    assert counts["cancelled"] + counts["cancelled_before_admission"] == NUM_CANCELS
    assert counts["cancelled"] >= 2 and counts["cancelled_before_admission"] >= NUM_CANCELS // 2, counts
    lines = end_lines(caplog, "request ")
    assert len(lines) == NUM_CANCELS
    unread = [line for line in lines if line.startswith("request - cancelled_before_admission ")]
    assert len(unread) == num_held > 0
    assert len({line.split()[1] for line in lines if line not in unread}) == NUM_CANCELS - num_held
    assert sum(" cancelled_before_admission " in line for line in lines) == counts["cancelled_before_admission"]


Scenario = Callable[[Harness, Script], Awaitable[grpc.StatusCode]]


async def served(h: Harness, script: Script) -> grpc.StatusCode:
    got = await h.generate(ids(1, 2, request_id="one", max_tokens=4))
    assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return grpc.StatusCode.OK


async def refused(h: Harness, script: Script) -> grpc.StatusCode:
    return await status_of(h.generate(ids(1, max_tokens=0, request_id="one")))


async def duplicate(h: Harness, script: Script) -> grpc.StatusCode:
    script.prefill_stall = True
    first = h.stub.Generate(ids(1, 2, request_id="same"))
    await eventually(lambda: bool(h.prefill.got(GenerateCmd, "same")))
    code = await status_of(h.generate(ids(1, 2, request_id="same")))
    first.cancel()  # NOTE: counted "cancelled": the test expects that one too
    return code


async def cancelled_at_the_prefill_worker(h: Harness, script: Script) -> grpc.StatusCode:
    script.prefill_stall = True
    call = h.stub.Generate(ids(1, 2, request_id="one"))
    await eventually(lambda: bool(h.prefill.got(GenerateCmd, "one")))
    call.cancel()
    return await call.code()


async def worker_error(h: Harness, script: Script) -> grpc.StatusCode:
    script.prefill_error = ("RESOURCE_EXHAUSTED", "the prompt needs 99 KV blocks")
    return await status_of(h.generate(ids(1, 2, request_id="one")))


async def worker_internal_error(h: Harness, script: Script) -> grpc.StatusCode:
    script.prefill_error = ("INTERNAL", "boom")
    return await status_of(h.generate(ids(1, 2, request_id="one")))


async def no_decode_worker(h: Harness, script: Script) -> grpc.StatusCode:
    h.decode.heartbeating = False
    await asyncio.sleep(HEARTBEAT_TIMEOUT + 0.2)
    return await status_of(h.generate(ids(1, 2, request_id="one")))


async def deadline(h: Harness, script: Script) -> grpc.StatusCode:
    script.prefill_stall = True
    return await status_of(drain(h.stub.Generate(ids(1, 2, request_id="one"), timeout=0.3)))


async def handler_bug(h: Harness, script: Script) -> grpc.StatusCode:
    def boom(self: RequestValidator, request: pb.GenerateRequest) -> None:
        raise RuntimeError("a bug")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RequestValidator, "validate", boom)
        return await status_of(h.generate(ids(1, 2, request_id="one")))


async def drain(call: grpc.aio.UnaryStreamCall) -> None:
    async for _ in call:
        pass


async def status_of(call: Awaitable[object]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


OUTCOME_CASES: list[tuple[Scenario, grpc.StatusCode, dict[str, int]]] = [
    (served, grpc.StatusCode.OK, {"ok": 1}),
    (refused, grpc.StatusCode.INVALID_ARGUMENT, {"invalid": 1}),
    (duplicate, grpc.StatusCode.ALREADY_EXISTS, {"already_exists": 1, "cancelled": 1}),
    (cancelled_at_the_prefill_worker, grpc.StatusCode.CANCELLED, {"cancelled": 1}),
    (worker_error, grpc.StatusCode.RESOURCE_EXHAUSTED, {"resource_exhausted": 1}),
    (no_decode_worker, grpc.StatusCode.UNAVAILABLE, {"unavailable": 1}),
    (deadline, grpc.StatusCode.DEADLINE_EXCEEDED, {"deadline_exceeded": 1}),
    (worker_internal_error, grpc.StatusCode.INTERNAL, {"internal": 1}),
    (handler_bug, grpc.StatusCode.UNKNOWN, {"internal": 1}),
]


@pytest.mark.parametrize(("scenario", "code", "expected"), OUTCOME_CASES, ids=[c[0].__name__ for c in OUTCOME_CASES])
def test_each_way_a_call_ends_is_one_outcome_and_one_log_line(
    smollm2_dir: Path, run_dir: Path, caplog: pytest.LogCaptureFixture, scenario: Scenario,
    code: grpc.StatusCode, expected: dict[str, int],
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO, "pdserve.router")

    async def body() -> dict[str, int]:
        script = Script([7, 8, 9, 10])
        async with router_with_fakes(smollm2_dir, run_dir, script) as h:
            assert await scenario(h, script) == code
            await eventually(lambda: sum(outcomes(h).values()) == sum(expected.values()))
            await asyncio.sleep(0.05)  # NOTE: a second count of the same call would show up by now
            return outcomes(h)

    assert asyncio.run(body()) == expected
    lines = end_lines(caplog, "request ")
    assert sorted(line.split()[2] for line in lines) == sorted(o for o, n in expected.items() for _ in range(n))
