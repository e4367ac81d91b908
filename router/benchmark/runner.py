"""Send a workload to a pdserve router, one task per request, and record every response's time: over grpc.aio
(pdserve.v1.Generation) or over HTTP (OpenAI completions, openai_client.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import multiprocessing
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from tqdm import tqdm

from pdserve.core.gc_pauses import freeze_startup_heap
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.router.benchmark.datasets import ClosedLoop, RequestSpec, Workload
from pdserve.router.benchmark.metrics import RequestRecord
from pdserve.router.benchmark.run_config import Clock, RunConfig, Sender
from pdserve.router.client_auth import ClientAuth

FINISH_NAMES = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in pb.FinishReason.items()}
TIMING_FIELDS = ("queue_ms", "prefill_ms", "handoff_ms", "first_token_ms")


async def fetch_model_info(address: str, timeout_s: float = 30.0, auth: ClientAuth | None = None) -> pb.ModelInfo:
    """GetModelInfo, waiting up to timeout_s for the router."""
    async with (auth or ClientAuth()).aio_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
        return await pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest())


def build_request(spec: RequestSpec, config: RunConfig) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        max_tokens=spec.output_len, ignore_eos=config.ignore_eos, temperature=config.temperature
    )
    if spec.send_as == "text":
        return pb.GenerateRequest(text=spec.text or "", sampling=sampling)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=spec.prompt_ids), sampling=sampling)


async def send_one(
    stub: pb_grpc.GenerationStub, config: RunConfig, spec: RequestSpec, index: int, clock: Clock
) -> RequestRecord:
    """Stream one request; a gRPC error or a token-count mismatch makes a failed record."""
    times: list[float] = []
    counts: list[int] = []
    last: pb.GenerateResponse | None = None
    request = build_request(spec, config)  # NOTE: before the clock starts, as vLLM's clients build their payload
    send = clock.now()
    error: str | None = None
    try:
        async for response in stub.Generate(request):
            times.append(clock.now())
            counts.append(len(response.token_ids))
            last = response
    except grpc.aio.AioRpcError as exc:
        error = f"{exc.code().name}: {exc.details()}"
    end = clock.now()
    usage = last.usage if last is not None else pb.Usage()
    if error is None and sum(counts) != usage.completion_tokens:
        error = f"output tokens {sum(counts)} != usage.completion_tokens {usage.completion_tokens}"
    timings = {name: getattr(last.timings, name) for name in TIMING_FIELDS} if last is not None else {}
    return RequestRecord(
        index, spec.tag, send, end, tuple(times), tuple(counts), usage.prompt_tokens, usage.cached_prompt_tokens,
        spec.output_len, FINISH_NAMES.get(last.finish_reason, "") if last is not None else "", error, timings,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def grpc_sender(config: RunConfig) -> AsyncIterator[Sender]:
    """send_one over config.grpc_channels channels (request i on channel i mod their number), once connected."""
    if config.grpc_channels == 1:
        async with config.auth.aio_channel(config.address) as channel:
            await asyncio.wait_for(channel.channel_ready(), config.ready_timeout_s)
            yield functools.partial(send_one, pb_grpc.GenerationStub(channel), config)
        return
    own_connection = [("grpc.use_local_subchannel_pool", 1)]  # NOTE: else channels to one address share one
    channels = [config.auth.aio_channel(config.address, own_connection) for _ in range(config.grpc_channels)]
    try:
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in channels)), config.ready_timeout_s)
        stubs = [pb_grpc.GenerationStub(c) for c in channels]

        def send(spec: RequestSpec, index: int, clock: Clock) -> Awaitable[RequestRecord]:
            return send_one(stubs[index % len(stubs)], config, spec, index, clock)

        yield send
    finally:
        await asyncio.gather(*(c.close() for c in channels))


def open_sender(config: RunConfig) -> contextlib.AbstractAsyncContextManager[Sender]:
    """The sender of config.backend."""
    if config.backend == "openai":
        from pdserve.router.benchmark.openai_client import openai_sender  # NOTE: aiohttp only where it is used

        return openai_sender(config)
    return grpc_sender(config)


async def _open_loop_one(
    send: Sender, spec: RequestSpec, index: int, clock: Clock, semaphore: asyncio.Semaphore | None,
    deadline_s: float | None = None,
) -> RequestRecord:  # fmt: skip
    await asyncio.sleep(max(0.0, (spec.start_time or 0.0) - clock.now()))
    if deadline_s is None:
        return await _sent(send, spec, index, clock, semaphore)
    send_time = clock.now()
    try:
        return await asyncio.wait_for(_sent(send, spec, index, clock, semaphore), max(0.0, deadline_s - send_time))
    except asyncio.TimeoutError:
        error = f"DEADLINE: still running {deadline_s:g} s after the start (cut off)"
        return RequestRecord(index, spec.tag, send_time, clock.now(), input_tokens=spec.prompt_len,
                             expected_output_len=spec.output_len, error=error)  # fmt: skip


async def _sent(
    send: Sender, spec: RequestSpec, index: int, clock: Clock, semaphore: asyncio.Semaphore | None
) -> RequestRecord:
    if semaphore is None:
        return await send(spec, index, clock)
    async with semaphore:
        return await send(spec, index, clock)


async def _closed_loop_stream(
    send: Sender,
    loop: ClosedLoop,
    counter: itertools.count,
    first_index: int,
    clock: Clock,
    done: Callable[[RequestRecord], None],
) -> list[RequestRecord]:
    """One closed-loop stream: send the next spec as soon as the previous one ends, until duration_s."""
    records = []
    while clock.now() < loop.duration_s:
        k = next(counter)
        record = await send(loop.spec(k), first_index + k, clock)
        records.append(record)
        done(record)
    return records


async def run_workload(workload: Workload, config: RunConfig, t0: float | None = None) -> list[RequestRecord]:
    """Run every open-loop request at its start time and the closed loop beside them; records by index.

    t0: the benchmark's start on the perf_counter clock (default: now); a client process of a split
    workload waits for it, so that every process shares time zero.
    """
    loop = workload.closed_loop
    total = len(workload.requests) if loop is None else None
    bar = tqdm(total=total, disable=not config.show_progress, unit="req")
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

    def done(_: RequestRecord) -> None:
        bar.update(1)

    async with open_sender(config) as send:
        freeze_startup_heap()  # NOTE: the workload's prompts and the client's set-up never need scanning again
        clock = Clock(t0)
        await asyncio.sleep(max(0.0, -clock.now()))
        tasks = []
        for i, spec in enumerate(workload.requests):
            task = asyncio.create_task(_open_loop_one(send, spec, i, clock, semaphore, config.deadline_s))
            task.add_done_callback(lambda t: done(t.result()) if not t.cancelled() and not t.exception() else None)
            tasks.append(task)
        counter = itertools.count()
        streams = [
            asyncio.create_task(_closed_loop_stream(send, lp, counter, len(tasks), clock, done))
            for lp in ([loop] * loop.num_streams if loop is not None else [])
        ]
        opened = await asyncio.gather(*tasks)
        closed = await asyncio.gather(*streams)
    bar.close()
    return sorted([*opened, *(r for stream in closed for r in stream)], key=lambda r: r.index)


def shard(workload: Workload, k: int, n: int) -> Workload:
    """Client process k of n: every n-th open-loop request and its share of the closed-loop streams (with
    its own prompt seed, so that processes never send the same prompt)."""
    loop = workload.closed_loop
    if loop is not None:
        streams = loop.num_streams // n + (1 if k < loop.num_streams % n else 0)
        loop = dataclasses.replace(loop, num_streams=streams, seed=loop.seed + 7919 * k) if streams else None
    return Workload(workload.requests[k::n], loop)


def _run_shard(workload: Workload, config: RunConfig, t0: float) -> list[RequestRecord]:
    return asyncio.run(run_workload(workload, config, t0))


def run_in_processes(workload: Workload, config: RunConfig, processes: int) -> list[RequestRecord]:
    """The workload split over client processes, one event loop each, records merged (indexed by send time).

    NOTE: one Python gRPC client handles a few thousand responses a second; a server streaming more than that
    would otherwise be measured through a saturated client.
    """
    if processes <= 1:
        return asyncio.run(run_workload(workload, config))
    t0 = time.perf_counter() + 2.0  # NOTE: time zero, after every process has started and connected
    limit = config.max_concurrency
    quiet = dataclasses.replace(config, show_progress=False, max_concurrency=-(-limit // processes) if limit else None)
    args = [(shard(workload, k, processes), quiet, t0) for k in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.starmap(_run_shard, args)
    merged = sorted((r for part in parts for r in part), key=lambda r: (r.send_time, r.tag))
    return [dataclasses.replace(r, index=i) for i, r in enumerate(merged)]
