"""The OpenAI-compatible HTTP API of a real CPU cluster (tiny Llama, 1 prefill + 1 decode worker), driven by the
official `openai` client: completions and chat, streamed and not, give the same greedy tokens as gRPC; a client
that disconnects mid-stream has every KV block back within 1 s."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import stream, wait_blocks_returned

pytestmark = pytest.mark.slow
NEW_TOKENS = 16
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
"""The tiny Llama has no chat template; the router renders this one."""
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = tmp_path_factory.mktemp("model") / "tiny-llama"
    shutil.copytree(tiny_llama_dir, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    with running(model, tmp_path_factory.mktemp("run"), 1, 1, "--num-blocks", "256") as c:
        yield c


def client(cluster: Cluster) -> Any:
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0)


def grpc_text(cluster: Cluster, request: pb.GenerateRequest) -> tuple[str, int]:
    """The text and number of tokens gRPC streams for request."""
    got = asyncio.run(stream(cluster.address, request))
    return "".join(r.text for r in got), sum(len(r.token_ids) for r in got)


GREEDY = {"temperature": 0, "max_tokens": NEW_TOKENS, "extra_body": {"ignore_eos": True}}


def grpc_sampling() -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_completions_give_the_greedy_tokens_of_grpc(cluster: Cluster) -> None:
    sdk = client(cluster)
    model = sdk.models.list().data[0].id
    for prompt, request in [
        ("The quick brown fox", pb.GenerateRequest(text="The quick brown fox", sampling=grpc_sampling())),
        ([5, 17, 99, 300], pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 17, 99, 300]), sampling=grpc_sampling())),
    ]:
        expected, num_tokens = grpc_text(cluster, request)
        assert num_tokens == NEW_TOKENS and expected
        whole = sdk.completions.create(model=model, prompt=prompt, **GREEDY)
        assert whole.choices[0].text == expected and whole.usage.completion_tokens == NEW_TOKENS
        assert whole.choices[0].finish_reason == "length"
        chunks = list(sdk.completions.create(model=model, prompt=prompt, stream=True, **GREEDY,
                                             stream_options={"include_usage": True}))  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert chunks[-1].usage.completion_tokens == NEW_TOKENS
    wait_blocks_returned(cluster)


def test_chat_gives_the_greedy_tokens_of_grpc(cluster: Cluster) -> None:
    sdk = client(cluster)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in MESSAGES])
    expected, num_tokens = grpc_text(cluster, pb.GenerateRequest(chat=chat, sampling=grpc_sampling()))
    assert num_tokens == NEW_TOKENS and expected
    model = sdk.models.list().data[0].id
    whole = sdk.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    assert whole.choices[0].message.content == expected and whole.usage.completion_tokens == NEW_TOKENS
    chunks = list(sdk.chat.completions.create(model=model, messages=MESSAGES, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_disconnect_mid_stream_returns_every_block_within_a_second(cluster: Cluster) -> None:
    url = urlsplit(cluster.http_url)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        sock.sendall(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
        seen = b""
        while seen.count(b"data: ") < 3:
            chunk = sock.recv(65536)
            assert chunk, seen
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in seen
    assert wait_blocks_returned(cluster, timeout=1.0) <= 1.0


def test_bad_request_is_an_openai_400(cluster: Cluster) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(cluster).completions.create(model="tiny-llama", prompt="x", max_tokens=0)
    assert err.value.status_code == 400 and err.value.param == "max_tokens"
