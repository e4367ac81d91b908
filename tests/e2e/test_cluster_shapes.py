"""The same concurrent-streams equality on other cluster shapes (2 prefill + 2 decode) and on the real
SmolLM2, plus text and chat input through the router's tokenizer and detokenizer; on each shape a killed decode
worker is back within 10 s."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.cluster import Cluster
from tests.e2e.test_cluster import (
    NEW_TOKENS,
    WORKER_FLAGS,
    engine_greedy,
    generate_all,
    greedy_request,
    stream,
    tokens_of,
)
from tests.e2e.test_cluster import wait_blocks_returned as wait_all_blocks
from tests.hf_reference import hf_greedy, random_prompts

SHAPES = {"tiny-2p2d": ("tiny_llama_dir", 2, 2), "smollm2-1p1d": ("smollm2_dir", 1, 1)}


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    fixture, prefill, decode = SHAPES[request.param]
    model_dir = request.getfixturevalue(fixture)
    cluster = Cluster(model_dir, tmp_path_factory.mktemp("run"), prefill, decode, *WORKER_FLAGS)
    try:
        cluster.wait_ready()
        yield cluster, model_dir
    finally:
        cluster.stop()


def test_concurrent_streams_match_engine_and_hf(shaped: tuple[Cluster, Path]) -> None:
    cluster, model_dir = shaped
    num_prefill = sum(1 for r in cluster.status()["roles"] if r["name"].startswith("prefill"))
    num_decode = sum(1 for r in cluster.status()["roles"] if r["name"].startswith("decode"))
    vocab = 1024 if "tiny" in str(model_dir) else 49152
    prompts = random_prompts(vocab, [2 + 5 * i for i in range(16)], seed=51)
    got = [tokens_of(r) for r in asyncio.run(generate_all(cluster.address, prompts))]
    assert got == engine_greedy(model_dir, prompts)
    assert got == hf_greedy(model_dir, prompts, NEW_TOKENS)
    wait_all_blocks(cluster, num_prefill, num_decode)
    for j in range(num_decode):
        assert cluster.stats("decode", j)["counters"]["prefill_tokens_computed"] == 0
    if num_decode > 1:  # least-loaded dispatch spreads 16 concurrent requests over both decode workers
        assert all(cluster.stats("decode", j)["counters"]["blocks_pulled"] > 0 for j in range(num_decode))


@pytest.mark.parametrize("shaped", ["smollm2-1p1d"], indirect=True)
def test_chat_and_text_streams_detokenize(shaped: tuple[Cluster, Path]) -> None:
    cluster, model_dir = shaped
    tok = AutoTokenizer.from_pretrained(model_dir)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])
    greedy = pb.SamplingParams(temperature=0.0, max_tokens=30)
    responses = asyncio.run(stream(cluster.address, pb.GenerateRequest(chat=chat, sampling=greedy)))
    text = "".join(r.text for r in responses)
    assert "Paris" in text
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP  # <|im_end|> is the eos
    assert text == tok.decode(tokens_of(responses), skip_special_tokens=True)
    stop = pb.SamplingParams(temperature=0.0, max_tokens=30, stop=[" Paris"])
    cut = asyncio.run(stream(cluster.address, pb.GenerateRequest(chat=chat, sampling=stop)))
    cut_text = "".join(r.text for r in cut)
    assert cut[-1].finish_reason == pb.FINISH_REASON_STOP
    assert text.startswith(cut_text) and "Paris" not in cut_text
    plain = asyncio.run(
        stream(
            cluster.address,
            pb.GenerateRequest(text="The quick brown fox", sampling=pb.SamplingParams(temperature=0.0, max_tokens=8)),
        )
    )
    assert plain[-1].usage.prompt_tokens == len(tok("The quick brown fox")["input_ids"])
    assert len(tokens_of(plain)) == 8


RESTART_WITHIN_S = 10.0


async def first_token_at(address: str, prompt: list[int]) -> tuple[float, list[int]]:
    """(monotonic time of the first streamed token, every token) of one greedy stream."""
    first, tokens = 0.0, []
    async with grpc.aio.insecure_channel(address) as channel:
        async for response in pb_grpc.GenerationStub(channel).Generate(greedy_request(prompt), timeout=60):
            first = first or time.monotonic()
            tokens += response.token_ids
    return first, tokens


def test_killed_decode_worker_serves_again_within_10_s(shaped: tuple[Cluster, Path]) -> None:
    """kill -9 of decode-0 while idle: within 10 s its new process heartbeats and streams a first token (retried
    while the router answers UNAVAILABLE: no decode worker up yet), and the prompt gives the same tokens as
    before. Last in this file: the cluster is not the same afterwards."""
    cluster, model_dir = shaped
    vocab = 1024 if "tiny" in str(model_dir) else 49152
    [prompt] = random_prompts(vocab, [9], seed=53)
    _, before = asyncio.run(first_token_at(cluster.address, prompt))
    old = cluster.stats("decode", 0)["incarnation"]
    killed = time.monotonic()
    os.kill(cluster.pid("decode-0"), signal.SIGKILL)
    cluster.wait_for(lambda: cluster.stats("decode", 0)["incarnation"] != old, RESTART_WITHIN_S, "decode-0 back")
    back = time.monotonic() - killed
    while True:
        try:
            first, after = asyncio.run(first_token_at(cluster.address, prompt))
            break
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - killed < RESTART_WITHIN_S, exc
            time.sleep(0.05)
    print(f"decode-0 heartbeats {back:.2f} s and streams a first token {first - killed:.2f} s after kill -9")
    assert after == before and first - killed <= RESTART_WITHIN_S
