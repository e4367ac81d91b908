"""The benchmark's HTTP backend: streamed OpenAI completions (POST /v1/completions, server-sent events) over aiohttp,
recorded as the gRPC backend records its responses (runner.send_one), so both doors share metrics.py.

A response is one SSE chunk that carries output (text, or token ids); its time is when its `data:` line arrived.
Token counts per chunk are exact when chunks carry `token_ids` (vLLM's extension); otherwise each chunk counts one
token and the rest of usage.completion_tokens goes to the last chunk, so totals, TPOT and E2EL stay exact while
ITL is per chunk, as vLLM's benchmark_serving measures it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.router.benchmark.datasets import RequestSpec
from pdserve.router.benchmark.metrics import RequestRecord
from pdserve.router.benchmark.run_config import Clock, RunConfig, Sender

COMPLETIONS_PATH = "/v1/completions"
READY_POLL_S = 0.2


def base_url(address: str) -> str:
    """host:port or a URL, as the URL the paths go after."""
    return (address if "://" in address else f"http://{address}").rstrip("/")


def completion_body(spec: RequestSpec, config: RunConfig) -> dict[str, Any]:
    """The JSON of one streamed completion request: the prompt as token ids (or text), exactly output_len tokens
    when config.ignore_eos."""
    prompt: Any = spec.text if spec.send_as == "text" else list(spec.prompt_ids)
    return {
        "model": config.model_name,
        "prompt": prompt,
        "max_tokens": spec.output_len,
        "temperature": config.temperature,
        "ignore_eos": config.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # NOTE: vLLM's extension: exact counts, and tokens with no text still count
    }


@dataclass
class CompletionStream:
    """One streamed completion as its chunks arrive."""

    times: list[float] = field(default_factory=list)
    """When each chunk with output arrived (the clock's seconds)."""
    counts: list[int] = field(default_factory=list)
    """Tokens of each such chunk (1 where the chunk has no token_ids)."""
    exact_counts: bool = True
    """Every chunk with output carried token_ids."""
    finish_reason: str = ""
    usage: dict[str, Any] | None = None
    error: str | None = None

    def feed_line(self, line: bytes, now: float) -> bool:
        """One line of the event stream; False once the stream is over ([DONE] or an error)."""
        if not line.startswith(b"data:"):
            return True  # NOTE: blank separators, comments, event: / id: fields
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return False
        try:
            chunk = json.loads(payload)
        except ValueError:
            self.error = f"bad SSE data: {payload[:200]!r}"
            return False
        if not isinstance(chunk, dict) or "error" in chunk:
            self.error = f"error chunk: {str(chunk)[:300]}"
            return False
        self.feed_chunk(chunk, now)
        return True

    def feed_chunk(self, chunk: dict[str, Any], now: float) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids")
            num_tokens = len(ids) if ids is not None else int(bool(choice.get("text")))
            self.exact_counts &= ids is not None or num_tokens == 0
            if num_tokens:
                self.times.append(now)
                self.counts.append(num_tokens)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])

    def record(self, spec: RequestSpec, index: int, send: float, end: float) -> RequestRecord:
        """The stream as a RequestRecord; failed when usage is missing or disagrees with the chunks' tokens."""
        usage = self.usage or {}
        completion = int(usage.get("completion_tokens", 0))
        counts, error = list(self.counts), self.error
        if error is None and self.usage is None:
            error = "no usage chunk (stream_options.include_usage)"
        elif error is None and counts and not self.exact_counts and sum(counts) < completion:
            counts[-1] += completion - sum(counts)
        if error is None and sum(counts) != completion:
            error = f"output tokens {sum(counts)} != usage.completion_tokens {completion}"
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return RequestRecord(
            index, spec.tag, send, end, tuple(self.times), tuple(counts), int(usage.get("prompt_tokens", 0)),
            int(cached), spec.output_len, self.finish_reason, error,
        )  # fmt: skip


async def send_completion(
    session: aiohttp.ClientSession, url: str, config: RunConfig, spec: RequestSpec, index: int, clock: Clock
) -> RequestRecord:
    """Stream one completion; an HTTP or connection error, an error chunk or a token mismatch fails it."""
    body = completion_body(spec, config)  # NOTE: before the clock starts, as runner.send_one
    stream = CompletionStream()
    send = clock.now()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                stream.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                async for line in resp.content:
                    if not stream.feed_line(line, clock.now()):
                        break
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    return stream.record(spec, index, send, clock.now())


async def wait_listening(session: aiohttp.ClientSession, url: str, timeout_s: float) -> None:
    """Until the server answers HTTP at all (any status); TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with session.get(url) as resp:
                await resp.read()
                return
        except aiohttp.ClientConnectionError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing answers HTTP at {url} after {timeout_s:g} s") from None
            await asyncio.sleep(READY_POLL_S)


@contextlib.asynccontextmanager
async def openai_sender(config: RunConfig) -> AsyncIterator[Sender]:
    """send_completion over one aiohttp session: HTTP/1.1 keep-alive, no limit on connections (one per stream)."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.ready_timeout_s)
    base = base_url(config.address)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await wait_listening(session, f"{base}/v1/models", config.ready_timeout_s)
        yield functools.partial(send_completion, session, base + COMPLETIONS_PATH, config)
