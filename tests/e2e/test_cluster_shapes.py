"""The same concurrent-streams equality on other cluster shapes (2 prefill + 2 decode) and on the real
SmolLM2, plus text and chat input through the router's tokenizer and detokenizer."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from tests.e2e.cluster import Cluster
from tests.e2e.test_cluster import NEW_TOKENS, WORKER_FLAGS, engine_greedy, generate_all, stream, tokens_of
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
