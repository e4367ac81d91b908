"""Logprobs end to end on CPU: gRPC -> router -> prefill (first token, and again from cached logits on an exact
hit) -> decode, and colocated, each token's logprob and top 5 == transformers fp32 within 1e-4."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import stream, tokens_of
from tests.hf_reference import random_prompts
from tests.logprobs_reference import assert_matches, hf_logprobs

NEW_TOKENS = 12
TOP = 5
MODES = {
    "disaggregated": ("prefill", ("--num-blocks", "256")),
    "colocated": ("decode", ("--colocated", "--num-blocks", "256")),
}


class Served(NamedTuple):
    cluster: Cluster
    sampler_role: str
    """The role of the worker that samples first tokens (its counters count the exact hits)."""


@pytest.fixture(scope="module", params=list(MODES))
def served(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    role, flags = MODES[request.param]
    with running(tiny_llama_dir, tmp_path_factory.mktemp("run"), 1, 1, *flags) as c:
        yield Served(c, role)


def logprobs_request(prompt: list[int], temperature: float = 0.0, seed: int | None = None) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        temperature=temperature, seed=seed, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=TOP
    )
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


def check(model_dir: Path, prompt: list[int], responses: list[pb.GenerateResponse], temperature: float = 1.0) -> None:
    """One Logprobs per token in every response; all of them == transformers' log_softmax(logits / T)."""
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    tokens = tokens_of(responses)
    entries = [e for r in responses for e in r.logprobs]
    assert len(tokens) == NEW_TOKENS
    ref = hf_logprobs(model_dir, prompt, tokens, TOP, temperature)
    chosen = [e.logprob for e in entries]
    assert_matches(
        chosen, [[t.token_id for t in e.top] for e in entries], [[t.logprob for t in e.top] for e in entries], ref
    )


def full_hits(served: Served) -> int:
    return int(served.cluster.stats(served.sampler_role, 0)["counters"]["full_hits"])


def test_greedy_logprobs_match_hf_from_the_first_token_and_from_an_exact_hit(
    served: Served, tiny_llama_dir: Path
) -> None:
    cluster = served.cluster
    (prompt,) = random_prompts(1024, (37,), seed=71)
    first = asyncio.run(stream(cluster.address, logprobs_request(prompt)))
    check(tiny_llama_dir, prompt, first)
    time.sleep(0.6)  # NOTE: two heartbeats, so the stats file holds the first request's counts
    hits = full_hits(served)
    again = asyncio.run(stream(cluster.address, logprobs_request(prompt)))
    assert tokens_of(again) == tokens_of(first)
    check(tiny_llama_dir, prompt, again)
    cluster.wait_for(lambda: full_hits(served) == hits + 1, 5.0, "the second request's first token from cached logits")


def test_seeded_sampling_logprobs_are_after_temperature(served: Served, tiny_llama_dir: Path) -> None:
    (prompt,) = random_prompts(1024, (19,), seed=72)
    responses = asyncio.run(stream(served.cluster.address, logprobs_request(prompt, temperature=0.8, seed=9)))
    check(tiny_llama_dir, prompt, responses, temperature=0.8)


def test_requests_that_do_not_ask_get_no_logprobs(served: Served) -> None:
    (prompt,) = random_prompts(1024, (9,), seed=73)
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
    responses = asyncio.run(stream(served.cluster.address, request))
    assert len(tokens_of(responses)) == 4 and not any(r.logprobs for r in responses)
