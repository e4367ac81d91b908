"""pdserve-bench-serving --backend openai against a tiny Starlette app that streams OpenAI-shaped completions (SSE):
the request it sends, exact token counts, TTFT from the first chunk with output, usage from the last chunk, and
failed records for HTTP errors and token mismatches."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.router.benchmark.datasets import RequestSpec, Workload
from pdserve.router.benchmark.metrics import RequestRecord, compute_metrics
from pdserve.router.benchmark.openai_client import CompletionStream
from pdserve.router.benchmark.run_config import RunConfig
from pdserve.router.benchmark.runner import run_workload

FIRST_CHUNK_DELAY_S = 0.05
"""The app's pause between its empty first chunk and the first chunk with text."""


class FakeOpenAI:
    """Streams max_tokens tokens in chunks of `chunk_sizes` (cycled), after an empty role-like chunk; the finish
    reason rides on the last text chunk and usage on a final chunk without choices, as OpenAI's API does."""

    def __init__(self, chunk_sizes: tuple[int, ...] = (1,), token_ids: bool = False, usage_delta: int = 0) -> None:
        self.chunk_sizes = chunk_sizes
        self.token_ids = token_ids
        self.usage_delta = usage_delta
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> Starlette:
        routes = [Route("/v1/completions", self.completions, methods=["POST"]), Route("/v1/models", self.models)]
        return Starlette(routes=routes)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        if body["max_tokens"] > 100:
            return JSONResponse({"error": {"message": "max_tokens too large"}}, status_code=400)
        return StreamingResponse(self.events(body), media_type="text/event-stream")

    async def events(self, body: dict[str, Any]) -> AsyncIterator[str]:
        n, sizes = body["max_tokens"], self.chunk_sizes
        yield sse(chunk([choice("", None)]))
        await asyncio.sleep(FIRST_CHUNK_DELAY_S)
        sent, k = 0, 0
        while sent < n:
            size = min(sizes[k % len(sizes)], n - sent)
            ids = list(range(sent, sent + size))
            piece = choice("".join(f" t{i}" for i in ids), "length" if sent + size == n else None)
            if self.token_ids:
                piece["token_ids"] = ids
            yield sse(chunk([piece]))
            sent, k = sent + size, k + 1
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n + self.usage_delta}
        yield sse({**chunk([]), "usage": usage})
        yield "data: [DONE]\n\n"


def choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny", "choices": choices}


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run_against(fake: FakeOpenAI, specs: list[RequestSpec]) -> list[RequestRecord]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app(), host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        config = RunConfig(f"127.0.0.1:{port}", show_progress=False, backend="openai", model_name="tiny")
        return await run_workload(Workload(tuple(specs)), config)
    finally:
        server.should_exit = True
        await serving


def spec(output_len: int, prompt_len: int = 5) -> RequestSpec:
    return RequestSpec(tuple(range(10, 10 + prompt_len)), output_len, start_time=0.0)


def test_request_is_a_streamed_completion_of_token_ids_with_usage_and_ignore_eos() -> None:
    fake = FakeOpenAI()
    asyncio.run(run_against(fake, [spec(3)]))
    assert fake.bodies == [
        {
            "model": "tiny", "prompt": [10, 11, 12, 13, 14], "max_tokens": 3, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
        }
    ]  # fmt: skip


def test_token_ids_in_chunks_give_exact_counts_per_response() -> None:
    (record,) = asyncio.run(run_against(FakeOpenAI(chunk_sizes=(1, 3, 2), token_ids=True), [spec(10)]))
    assert record.ok, record.error
    assert record.response_tokens == (1, 3, 2, 1, 3)
    assert (record.output_tokens, record.input_tokens, record.finish_reason) == (10, 5, "length")


def test_chunks_without_token_ids_count_one_each_and_usage_gives_the_rest_to_the_last() -> None:
    (record,) = asyncio.run(run_against(FakeOpenAI(chunk_sizes=(1, 3)), [spec(6)]))
    assert record.ok, record.error
    assert record.response_tokens == (1, 1, 1, 3)  # chunks of 1, 3, 1, 1 tokens; usage says 6
    assert len(record.itls) == 3


def test_ttft_is_the_first_chunk_with_output_and_metrics_count_every_token() -> None:
    records = asyncio.run(run_against(FakeOpenAI(), [spec(4), spec(7)]))
    assert all(r.ok for r in records)
    assert all(r.ttft >= FIRST_CHUNK_DELAY_S for r in records)  # NOTE: the empty first chunk does not count
    metrics = compute_metrics(records, (50, 99))
    assert (metrics["completed"], metrics["failed"], metrics["total_output_tokens"]) == (2, 0, 11)
    assert metrics["total_input_tokens"] == 10


def test_http_error_and_usage_mismatch_make_failed_records() -> None:
    (too_long,) = asyncio.run(run_against(FakeOpenAI(), [spec(101)]))
    assert too_long.error is not None and too_long.error.startswith("HTTP 400")
    (mismatch,) = asyncio.run(run_against(FakeOpenAI(token_ids=True, usage_delta=1), [spec(4)]))
    assert mismatch.error == "output tokens 4 != usage.completion_tokens 5"


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        ([b"data: {not json\n"], "bad SSE data"),
        ([b'data: {"error": {"message": "boom"}}\n'], "error chunk"),
        ([b'data: {"choices": [{"text": "a", "finish_reason": "length"}]}\n', b"data: [DONE]\n"], "no usage chunk"),
    ],
)
def test_bad_streams_fail_with_their_reason(lines: list[bytes], error: str) -> None:
    stream = CompletionStream()
    for line in lines:
        if not stream.feed_line(line, 1.0):
            break
    record = stream.record(spec(1), 0, 0.0, 2.0)
    assert record.error is not None and record.error.startswith(error)


def test_comments_and_blank_lines_are_skipped_and_usage_may_ride_on_the_last_choice() -> None:
    stream = CompletionStream()
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 2}}
    lines = [
        b": keep-alive\n", b"\n", b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n', b"\n",
        b"data: " + json.dumps({"choices": [{"text": "b", "finish_reason": "stop"}], "usage": usage}).encode() + b"\n",
    ]  # fmt: skip
    assert all(stream.feed_line(line, float(k)) for k, line in enumerate(lines))
    assert not stream.feed_line(b"data: [DONE]\n", 9.0)
    record = stream.record(spec(2), 0, 0.0, 9.0)
    assert record.ok and record.response_times == (2.0, 4.0) and record.response_tokens == (1, 1)
    assert (record.finish_reason, record.input_tokens, record.cached_tokens) == ("stop", 3, 2)
