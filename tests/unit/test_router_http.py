"""The OpenAI-compatible HTTP API (router/http_api.py) with fake workers: the official `openai` client for
completions and chat, whole and streamed; OpenAI-shaped refusals with their status codes; a client that
disconnects frees the request at the workers; API keys."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from pdserve.core.messages import AbortCmd, GenerateCmd, pack_token_ids
from pdserve.router.auth import EdgeSecurity
from pdserve.router.outcome import OUTCOMES
from pdserve.router.tokenizer import RouterTokenizer
from tests.router_fakes import Harness, Script, eventually, router_with_fakes

OUTPUT_TEXT = "Hello 👋🏽 wörld! 日本語 — done."
MODEL = "SmolLM2-135M-Instruct"
STALLED = Script(list(range(100, 140)), decode_stall_after=3)
"""Streams that never finish: the decode worker sends a few tokens, then waits."""


def sdk(h: Harness, api_key: str = "none") -> Any:
    """An AsyncOpenAI client of the router's HTTP API (Any: the SDK's request types list OpenAI's models only)."""
    assert h.router.http_url is not None
    return openai.AsyncOpenAI(base_url=h.router.http_url + "/v1", api_key=api_key, max_retries=0)


def outcomes(h: Harness) -> dict[str, int]:
    registry = h.router.metrics.registry
    counts = {o: registry.get_sample_value("pdserve_requests_total", {"outcome": o}) for o in OUTCOMES}
    return {o: int(n) for o, n in counts.items() if n}


def cmd_ids(h: Harness) -> list[str]:
    """Request ids of the GenerateCmds the prefill worker received, in order."""
    return [m.request_id for m in h.prefill.got(GenerateCmd) if isinstance(m, GenerateCmd)]


async def send(h: Harness, method: str, path: str, body: Any = None, headers: str = "") -> tuple[int, Any]:
    """One raw HTTP/1.1 request (bytes or JSON body); the status and the JSON body."""
    reader, writer = await connect(h, method, path, body, headers)
    data = await reader.read()
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


async def connect(
    h: Harness, method: str, path: str, body: Any = None, headers: str = ""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    assert h.router.http_url is not None
    url = urlsplit(h.router.http_url)
    raw = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    head = f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n"
    writer.write(f"{head}content-length: {len(raw)}\r\n{headers}\r\n".encode() + raw)
    await writer.drain()
    return reader, writer


async def open_stream(h: Harness, body: dict[str, Any]) -> asyncio.StreamWriter:
    """A streamed completion whose first event has arrived; closing the writer disconnects."""
    reader, writer = await connect(h, "POST", "/v1/completions", {**body, "stream": True})
    seen = b""
    while b"data: " not in seen:
        chunk = await asyncio.wait_for(reader.read(4096), 5.0)
        assert chunk, seen
        seen += chunk
    assert seen.startswith(b"HTTP/1.1 200"), seen
    return writer


def test_completion_matches_the_grpc_path_and_maps_every_sampling_field(
    smollm2_dir: Path, run_dir: Path, tokenizer: RouterTokenizer
) -> None:
    tokens = tokenizer.encode(OUTPUT_TEXT)

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script(tokens, num_cached_tokens=3), http_port=0) as h:
            extra = {"top_k": 7, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [5]}
            got = await sdk(h).completions.create(
                model=MODEL, prompt="Say hello", max_tokens=len(tokens), temperature=0, top_p=0.5, seed=5,
                stop=["zzz"], user="u1", extra_body=extra,
            )  # fmt: skip
            assert got.id.startswith("cmpl-") and got.object == "text_completion" and got.model == MODEL
            (choice,) = got.choices
            assert (choice.text, choice.finish_reason, choice.logprobs) == (OUTPUT_TEXT, "length", None)
            assert got.usage is not None and got.usage.prompt_tokens_details is not None
            assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(tokenizer.encode("Say hello")),
                                                                               len(tokens))  # fmt: skip
            assert got.usage.total_tokens == got.usage.prompt_tokens + len(tokens)
            assert got.usage.prompt_tokens_details.cached_tokens == 3
            (cmd,) = h.prefill.got(GenerateCmd, got.id)
            assert isinstance(cmd, GenerateCmd) and cmd.token_ids == pack_token_ids(tokenizer.encode("Say hello"))
            s = cmd.sampling
            assert (s.temperature, s.top_p, s.top_k, s.seed, s.min_tokens) == (0, 0.5, 7, 5, 2)
            assert s.max_tokens == len(tokens)
            assert (tuple(s.stop_token_ids), s.ignore_eos) == ((5,), True)
            grpc_text = "".join(r.text for r in await h.generate(_grpc_request(tokens)))
            assert grpc_text == choice.text
            await eventually(lambda: outcomes(h) == {"ok": 2})

    asyncio.run(body())


def _grpc_request(tokens: list[int]) -> Any:
    from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb

    return pb.GenerateRequest(text="Say hello", sampling=pb.SamplingParams(temperature=0, max_tokens=len(tokens)))


def test_chat_stream_has_the_role_the_text_the_finish_and_a_usage_chunk(
    smollm2_dir: Path, run_dir: Path, tokenizer: RouterTokenizer
) -> None:
    tokens = tokenizer.encode(OUTPUT_TEXT)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script(tokens, finish_reason="stop"), http_port=0) as h:
            stream = await sdk(h).chat.completions.create(
                model=MODEL, messages=messages, max_completion_tokens=64, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            chunks = [c async for c in stream]
            assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == OUTPUT_TEXT
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert finishes[-1] == "stop" and not any(finishes[:-1])
            assert not chunks[-1].choices and chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == len(tokens)
            assert all(c.usage is None for c in chunks[:-1])
            (cmd,) = h.prefill.got(GenerateCmd, chunks[0].id)
            assert isinstance(cmd, GenerateCmd) and cmd.sampling.max_tokens == 64
            assert cmd.token_ids == pack_token_ids(tokenizer.encode_chat(messages))

    asyncio.run(body())


def test_completion_stream_of_token_ids_and_whole_chat(
    smollm2_dir: Path, run_dir: Path, tokenizer: RouterTokenizer
) -> None:
    tokens = tokenizer.encode(OUTPUT_TEXT)

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script(tokens), http_port=0) as h:
            client = sdk(h)
            stream = await client.completions.create(model=MODEL, prompt=[1, 2, 3], stream=True, max_tokens=99)
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].text for c in chunks) == OUTPUT_TEXT
            assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
            (cmd,) = h.prefill.got(GenerateCmd, chunks[0].id)
            assert isinstance(cmd, GenerateCmd) and cmd.token_ids == pack_token_ids([1, 2, 3])
            parts = [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]
            chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}])
            assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
            assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == OUTPUT_TEXT
            (cmd,) = h.prefill.got(GenerateCmd, chat.id)
            hi = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
            assert isinstance(cmd, GenerateCmd) and cmd.token_ids == pack_token_ids(hi)

    asyncio.run(body())


def test_models_and_health(smollm2_dir: Path, run_dir: Path) -> None:
    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([7]), heartbeat=False, http_port=0) as h:
            assert await send(h, "GET", "/health") == (503, {"status": "not_serving"})
            status, err = await send(h, "POST", "/v1/completions", {"prompt": "x"})
            assert status == 503 and err["error"]["type"] == "server_error" and err["error"]["code"] == "unavailable"
            h.prefill.heartbeating = h.decode.heartbeating = True
            await asyncio.wait_for(h.router.wait_ready(), 2.0)
            assert await send(h, "GET", "/health") == (200, {"status": "serving"})
            models = await sdk(h).models.list()
            assert [(m.id, m.object, m.owned_by) for m in models.data] == [(MODEL, "model", "pdserve")]
            status, err = await send(h, "GET", "/v1/nothing")
            assert status == 404 and err["error"]["message"] == "Not Found"
            assert (await send(h, "GET", "/v1/completions"))[0] == 405

    asyncio.run(body())


OK = {"model": MODEL, "prompt": "hi"}
BAD_REQUESTS: list[tuple[str, Any, int, str | None, str]] = [
    ("completions", b"{not json", 400, None, "not valid JSON"),
    ("completions", [1, 2], 400, None, "JSON object"),
    ("completions", {**OK, "model": "gpt-4"}, 404, "model", "does not exist"),
    ("completions", {**OK, "n": 2}, 400, "n", "n > 1 is not supported"),
    ("completions", {**OK, "max_tokens": "10"}, 400, "max_tokens", "must be an integer"),
    ("completions", {**OK, "max_tokens": 0}, 400, "max_tokens", "max_tokens must be > 0"),
    ("completions", {**OK, "max_tokens": 8192}, 400, "max_tokens", "exceeds the model's context length"),
    ("completions", {**OK, "temperature": "hot"}, 400, "temperature", "must be a number"),
    ("completions", {**OK, "temperature": -1}, 400, "temperature", "temperature must be finite and >= 0"),
    ("completions", {**OK, "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    ("completions", {**OK, "top_k": 1.5}, 400, "top_k", "must be an integer"),
    ("completions", {**OK, "seed": -1}, 400, "seed", "seed must be in [0,"),
    ("completions", {**OK, "stop": 7}, 400, "stop", "stop must be a list"),
    ("completions", {**OK, "stop_token_ids": [49152]}, 400, "stop_token_ids", "outside the vocabulary"),
    ("completions", {**OK, "ignore_eos": 1}, 400, "ignore_eos", "must be true or false"),
    ("completions", {**OK, "stream": "yes"}, 400, "stream", "must be true or false"),
    ("completions", {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed"),
    ("completions", {**OK, "best_of": 3}, 400, "best_of", "best_of is not supported"),
    ("completions", {**OK, "echo": True}, 400, "echo", "echo is not supported"),
    ("completions", {**OK, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("completions", {**OK, "logit_bias": {"5": 1}}, 400, "logit_bias", "not supported"),
    ("completions", {**OK, "frobnicate": 1}, 400, "frobnicate", "Unrecognized request argument"),
    ("completions", {"model": MODEL}, 400, "prompt", "prompt is required"),
    ("completions", {**OK, "prompt": ""}, 400, "prompt", "empty prompt"),
    ("completions", {**OK, "prompt": ["a", "b"]}, 400, "prompt", "several prompts"),
    ("completions", {**OK, "prompt": [1, 49152]}, 400, "prompt", "outside the vocabulary"),
    ("completions", {**OK, "prompt": [1, 2**40]}, 400, "prompt", "must be in"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "non-empty list"),
    ("chat/completions", {"messages": [{"role": 1, "content": "x"}]}, 400, "messages[0].role", "must be a string"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]", "only parts of type text"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs",
     "needs logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools", "tools is not supported"),
]  # fmt: skip
"""(endpoint, body, status, param, a piece of the message)."""


def test_bad_requests_get_openai_shaped_errors_naming_the_field(smollm2_dir: Path, run_dir: Path) -> None:
    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([5]), http_port=0) as h:
            for endpoint, request, status, param, message in BAD_REQUESTS:
                got, err = await send(h, "POST", f"/v1/{endpoint}", request)
                case = (request, err)
                assert got == status, case
                assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, case
                assert err["error"]["type"] == "invalid_request_error", case
                assert err["error"]["param"] == param and message in err["error"]["message"], case
            assert not h.prefill.got(GenerateCmd)
            assert outcomes(h) == {"invalid": len(BAD_REQUESTS)}
            with pytest.raises(openai.BadRequestError) as exc:
                await sdk(h).completions.create(model=MODEL, prompt="x", n=3)
            assert exc.value.param == "n"

    asyncio.run(body())
    assert len(BAD_REQUESTS) >= 20


def test_full_queue_is_429_and_a_disconnect_while_queued_leaves_the_queue(smollm2_dir: Path, run_dir: Path) -> None:
    # the fake decode worker has 128 blocks of 16 tokens; each request needs 2 + 1006 tokens: 63 blocks
    big = {"model": MODEL, "prompt": [1, 2], "max_tokens": 1006}

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, STALLED, http_port=0, block_size=16, max_queued=1) as h:
            running = [await open_stream(h, big) for _ in range(2)]
            _, queued = await connect(h, "POST", "/v1/completions", big)
            hub = h.router.hub
            await eventually(lambda: len(hub.admission) == 1)
            status, err = await send(h, "POST", "/v1/completions", big)
            assert status == 429 and err["error"]["type"] == "rate_limit_error"
            assert err["error"]["code"] == "resource_exhausted" and "waiting for KV room" in err["error"]["message"]
            queued.close()
            await eventually(lambda: len(hub.admission) == 0)
            for writer in running:
                writer.close()
            await eventually(lambda: len(hub.table) == 0 and +hub.table.reserved_at_decode == {})
            await eventually(lambda: outcomes(h) == {"resource_exhausted": 1, "cancelled": 2,
                                                     "cancelled_before_admission": 1})  # fmt: skip

    asyncio.run(body())


def test_disconnect_mid_stream_aborts_the_request_at_both_workers(smollm2_dir: Path, run_dir: Path) -> None:
    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, STALLED, http_port=0) as h:
            writer = await open_stream(h, {"prompt": "go", "max_tokens": 100})
            (rid,) = cmd_ids(h)
            writer.close()
            took = await eventually(lambda: bool(h.prefill.got(AbortCmd, rid) and h.decode.got(AbortCmd, rid)))
            assert took < 1.0
            await eventually(lambda: len(h.router.hub.table) == 0 and outcomes(h) == {"cancelled": 1})
            # a request that does not stream is cancelled the same way
            chat = {"messages": [{"role": "user", "content": "go"}]}
            _, writer = await connect(h, "POST", "/v1/chat/completions", chat)
            await eventually(lambda: len(cmd_ids(h)) == 2)
            second = cmd_ids(h)[-1]
            writer.close()
            await eventually(lambda: bool(h.prefill.got(AbortCmd, second) and h.decode.got(AbortCmd, second)))
            await eventually(lambda: len(h.router.hub.table) == 0 and outcomes(h) == {"cancelled": 2})

    asyncio.run(body())


def test_worker_error_is_its_status_or_an_error_event_in_the_stream(smollm2_dir: Path, run_dir: Path) -> None:
    script = Script([7], prefill_error=("RESOURCE_EXHAUSTED", "the prompt needs 99 KV blocks"))

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, script, http_port=0) as h:
            with pytest.raises(openai.RateLimitError) as exc:
                await sdk(h).completions.create(model=MODEL, prompt="x")
            assert "99 KV blocks" in exc.value.message
            stream = await sdk(h).completions.create(model=MODEL, prompt="x", stream=True)
            with pytest.raises(openai.APIError) as err:
                _ = [c async for c in stream]
            assert "99 KV blocks" in err.value.message

    asyncio.run(body())


def test_api_keys_guard_every_path_but_health(smollm2_dir: Path, run_dir: Path) -> None:
    security = EdgeSecurity(api_keys=("s3cret",))

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([7]), http_port=0, security=security) as h:
            status, err = await send(h, "GET", "/v1/models")
            assert status == 401 and err["error"]["code"] == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                await sdk(h, "wrong").completions.create(model=MODEL, prompt="x")
            got = await sdk(h, "s3cret").completions.create(model=MODEL, prompt="x")
            assert got.choices[0].finish_reason == "length"
            assert (await send(h, "GET", "/health"))[0] == 200

    asyncio.run(body())


def test_no_http_port_serves_no_http(smollm2_dir: Path, run_dir: Path) -> None:
    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([7])) as h:
            assert h.router.http is None and h.router.http_url is None

    asyncio.run(body())


def test_http_connections_are_accepted_with_nagle_off() -> None:
    """The listener is an IPPROTO_TCP socket, so asyncio sets TCP_NODELAY on each accepted connection (with Nagle
    on, a stream's first SSE chunk waits behind its headers for the client's delayed ACK)."""
    from pdserve.router.http_api import listening_socket

    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=listening_socket("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(seen, 5.0)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) == 1


def test_front_ends_share_the_http_port_only_with_reuse_port() -> None:
    from pdserve.router.http_api import listening_socket

    first = listening_socket("127.0.0.1", 0, reuse_port=True)
    port = first.getsockname()[1]
    try:
        second = listening_socket("127.0.0.1", port, reuse_port=True)  # another front end of the cluster
        second.close()
        with pytest.raises(OSError):
            listening_socket("127.0.0.1", port)  # one router alone keeps its port to itself
    finally:
        first.close()
