"""The OpenAI-compatible HTTP API of a real CPU cluster (tiny Llama, 1 prefill + 1 decode worker), driven by the
official `openai` client: completions and chat, streamed and not, give the same greedy tokens as gRPC and logprobs
equal to transformers fp32 within 1e-4; a client that disconnects mid-stream has every KV block back within 1 s."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import stream, wait_blocks_returned
from tests.hf_reference import hf_greedy, random_prompts
from tests.logprobs_reference import TOLERANCE, ReferenceLogprobs, hf_logprobs

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


TOP = 5


class Expected:
    """transformers' greedy tokens of one prompt and their fp32 logprobs, with the strings the API names them by."""

    def __init__(self, model_dir: Path, prompt: list[int]) -> None:
        (self.generated,) = hf_greedy(model_dir, [prompt], NEW_TOKENS)
        self.ref: ReferenceLogprobs = hf_logprobs(model_dir, prompt, self.generated, TOP)
        self.text = token_texts(str(model_dir))
        self.tokens = [self.text(t) for t in self.generated]

    def check_chosen(self, tokens: Sequence[str], logprobs: Sequence[float]) -> None:
        assert list(tokens) == self.tokens
        assert_close(logprobs, self.ref.chosen, "chosen tokens")

    def completion_tops(self) -> list[dict[str, float]]:
        """OpenAI completions' top_logprobs: token string -> logprob, the top 5 in rank order then the chosen token
        (a later entry replaces an earlier one of the same string, as the server's dict does)."""
        tops = []
        for ids, values, token, chosen in zip(self.ref.top_ids, self.ref.top_logprobs, self.tokens, self.ref.chosen,
                                              strict=True):  # fmt: skip
            top = {self.text(i): v for i, v in zip(ids, values, strict=True)}
            top[token] = chosen
            tops.append(top)
        return tops


@lru_cache(maxsize=2)
def token_texts(model_dir: str) -> Callable[[int], str]:
    """One token id -> its text as the model's tokenizer writes it alone (several byte tokens write '\ufffd')."""
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return lambda token_id: str(tokenizer.decode([token_id], skip_special_tokens=False))


def assert_close(got: Sequence[float], want: Sequence[float], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} values vs {len(want)}"
    worst = max((abs(g - w) for g, w in zip(got, want, strict=True)), default=0.0)
    assert worst <= TOLERANCE, f"{what}: {list(got)} vs {list(want)}"


def check_completion_logprobs(expected: Expected, logprobs: Mapping[str, list[Any]]) -> None:
    """tokens, token_logprobs, top_logprobs and text_offset of a whole completion or its chunks joined."""
    expected.check_chosen(logprobs["tokens"], logprobs["token_logprobs"])
    for i, (got, want) in enumerate(zip(logprobs["top_logprobs"], expected.completion_tops(), strict=True)):
        assert got.keys() == want.keys(), f"token {i}"
        assert_close([got[k] for k in want], list(want.values()), f"token {i}: top logprobs")
    lengths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]


def check_chat_logprobs(expected: Expected, content: Sequence[Any]) -> None:
    """Chat's logprobs.content: the chosen token and its logprob, the top 5's logprobs in rank order and their
    strings (as a multiset: ids that write the same string, or near ties, cannot make it flaky)."""
    expected.check_chosen([e.token for e in content], [e.logprob for e in content])
    for i, (entry, ids, values) in enumerate(zip(content, expected.ref.top_ids, expected.ref.top_logprobs,
                                                 strict=True)):  # fmt: skip
        assert entry.bytes == list(entry.token.encode())
        assert_close([t.logprob for t in entry.top_logprobs], values, f"token {i}: top logprobs")
        assert sorted(t.token for t in entry.top_logprobs) == sorted(expected.text(t) for t in ids), f"token {i}"


def joined_completion_logprobs(chunks: Sequence[Any]) -> dict[str, list[Any]]:
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for name, values in joined.items():
                values.extend(getattr(chunk.choices[0].logprobs, name))
    return joined


def test_completion_logprobs_match_hf_whole_and_streamed(cluster: Cluster, tiny_llama_dir: Path) -> None:
    sdk = client(cluster)
    (prompt,) = random_prompts(1024, (29,), seed=81)
    expected = Expected(tiny_llama_dir, prompt)
    whole = sdk.completions.create(model="tiny-llama", prompt=prompt, logprobs=TOP, **GREEDY)
    check_completion_logprobs(expected, whole.choices[0].logprobs.model_dump())
    chunks = list(sdk.completions.create(model="tiny-llama", prompt=prompt, logprobs=TOP, stream=True, **GREEDY))
    check_completion_logprobs(expected, joined_completion_logprobs(chunks))


def test_chat_logprobs_match_hf_whole_and_streamed(cluster: Cluster, tiny_llama_dir: Path) -> None:
    sdk = client(cluster)
    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    rendered = hf_tokenizer.apply_chat_template(
        MESSAGES, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    prompt = hf_tokenizer.encode(rendered, add_special_tokens=False)
    expected = Expected(tiny_llama_dir, prompt)
    asked = {"logprobs": True, "top_logprobs": TOP, **GREEDY}
    whole = sdk.chat.completions.create(model="tiny-llama", messages=MESSAGES, **asked)
    assert whole.usage.prompt_tokens == len(prompt)
    check_chat_logprobs(expected, whole.choices[0].logprobs.content)
    chunks = list(sdk.chat.completions.create(model="tiny-llama", messages=MESSAGES, stream=True, **asked))
    check_chat_logprobs(expected, [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content])
