"""router.validation: every bad request is refused with a message naming the problem; good ones convert to
the engine's defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.core.messages import Sampling
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.router.model_info import ModelSpec
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.validation import RequestValidator, ValidationError


@pytest.fixture(scope="module")
def validator(smollm2_dir: Path) -> RequestValidator:
    return RequestValidator(ModelSpec.from_dir(smollm2_dir), RouterTokenizer.from_dir(smollm2_dir))


def ids(*token_ids: int, **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=token_ids), sampling=pb.SamplingParams(**sampling))


def chat(contents: list[str]) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=c) for c in contents]))


BAD = [
    ("no-input", pb.GenerateRequest(), "empty"),
    ("empty-text", pb.GenerateRequest(text=""), "empty"),
    ("empty-token-ids", ids(), "empty"),
    ("empty-chat", pb.GenerateRequest(chat=pb.ChatMessages()), "empty"),
    ("prompt-fills-context", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 8192)), "context"),
    ("token-id-negative", ids(1, -1), "vocabulary"),
    ("token-id-past-vocab", ids(1, 49152), "vocabulary"),
    ("max-tokens-0", ids(1, max_tokens=0), "max_tokens"),
    ("max-tokens-negative", ids(1, max_tokens=-3), "max_tokens"),
    ("temperature-negative", ids(1, temperature=-0.5), "temperature"),
    ("temperature-nan", ids(1, temperature=float("nan")), "temperature"),
    ("temperature-inf", ids(1, temperature=float("inf")), "temperature"),
    ("top-p-0", ids(1, top_p=0.0), "top_p"),
    ("top-p-above-1", ids(1, top_p=1.5), "top_p"),
    ("top-p-nan", ids(1, top_p=float("nan")), "top_p"),
    ("top-k-negative", ids(1, top_k=-1), "top_k"),
    ("min-tokens-above-max", ids(1, max_tokens=4, min_tokens=5), "min_tokens"),
    ("min-tokens-negative", ids(1, min_tokens=-1), "min_tokens"),
    ("seed-too-large", ids(1, seed=2**63), "seed"),
    ("stop-token-past-vocab", ids(1, stop_token_ids=[49152]), "stop token"),
    ("empty-stop-string", ids(1, stop=["ok", ""]), "stop strings"),
    ("request-id-too-long", pb.GenerateRequest(text="hi", request_id="x" * 257), "request_id"),
    ("request-id-too-many-bytes", pb.GenerateRequest(text="hi", request_id="é" * 129), "over the limit of 256"),
    ("max-tokens-past-context", ids(1, 2, max_tokens=8191), "prompt (2 tokens) + max_tokens (8191) exceeds"),
    ("stop-strings-17", ids(1, stop=["a"] * 17), "stop: 17 strings, over the limit of 16"),
    ("stop-bytes-4097", ids(1, stop=["a" * 4097]), "stop: 4097 bytes in all, over the limit of 4096"),
    ("stop-token-ids-1025", ids(1, stop_token_ids=[2] * 1025), "over the limit of 1024"),
    ("chat-messages-1025", chat(["hi"] * 1025), "chat: 1025 messages, over the limit of 1024"),
    ("chat-bytes", chat(["x" * 262141]), "over the limit of 262144 (32 bytes per token of the 8192-token context)"),
    ("text-bytes", pb.GenerateRequest(text="é" * 131073), "text: 262146 bytes, over the limit of 262144"),
]
AT_LIMITS = [
    ("request-id-256-bytes", pb.GenerateRequest(text="hi", request_id="é" * 128)),
    ("max-tokens-fills-context", ids(1, 2, max_tokens=8190)),
    ("stop-strings-16-of-4096-bytes", ids(1, stop=["a" * 256] * 16)),
    ("stop-token-ids-1024", ids(1, stop_token_ids=[2] * 1024)),
    ("chat-messages-1024", chat(["hi"] * 1024)),
    ("text-262144-bytes-of-4096-tokens", pb.GenerateRequest(text="#" * 262144)),
]


@pytest.mark.parametrize(("request_", "needle"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_is_refused_with_a_message(
    validator: RequestValidator, request_: pb.GenerateRequest, needle: str
) -> None:
    with pytest.raises(ValidationError) as err:
        validator.validate(request_)
    assert needle in str(err.value)


@pytest.mark.parametrize("request_", [a[1] for a in AT_LIMITS], ids=[a[0] for a in AT_LIMITS])
def test_a_request_at_each_limit_passes(validator: RequestValidator, request_: pb.GenerateRequest) -> None:
    validator.validate(request_)


def test_unset_sampling_fields_take_the_engine_defaults_and_max_tokens_the_rest_of_the_context(
    validator: RequestValidator,
) -> None:
    valid = validator.validate(ids(5, 6, 7))
    assert valid.token_ids.dtype == np.int64 and valid.token_ids.tolist() == [5, 6, 7]
    assert valid.sampling == Sampling(temperature=1.0, top_k=0, top_p=1.0, seed=None, max_tokens=8189, min_tokens=0)
    assert valid.stop == ()


def test_set_sampling_fields_are_passed_on(validator: RequestValidator) -> None:
    req = ids(5, temperature=0.0, top_k=3, top_p=0.5, seed=7, max_tokens=9, min_tokens=2, stop_token_ids=[2],
              stop=["\n"], ignore_eos=True)  # fmt: skip
    valid = validator.validate(req)
    assert valid.sampling == Sampling(0.0, 3, 0.5, 7, 9, 2, (2,), True)
    assert valid.stop == ("\n",)


def test_text_and_chat_are_tokenized(validator: RequestValidator) -> None:
    tok = validator.tokenizer
    assert validator.validate(pb.GenerateRequest(text="Hello there")).token_ids.tolist() == tok.encode("Hello there")
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])
    expected = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert validator.validate(pb.GenerateRequest(chat=chat)).token_ids.tolist() == expected


def test_unknown_chat_roles_are_passed_to_the_template(validator: RequestValidator) -> None:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="tool", content="42")])
    messages = [{"role": "tool", "content": "42"}]
    assert "<|im_start|>tool\n42" in validator.tokenizer.render_chat(messages)
    assert validator.validate(pb.GenerateRequest(chat=chat)).token_ids.tolist() == validator.tokenizer.encode_chat(
        messages
    )


def test_model_spec_reads_limits_and_eos_ids(validator: RequestValidator) -> None:
    assert validator.model == ModelSpec("SmolLM2-135M-Instruct", 49152, 8192, (2,))


def test_a_bad_token_id_is_named_with_its_position(validator: RequestValidator) -> None:
    with pytest.raises(ValidationError, match=r"token id 49152 at position 2 outside"):
        validator.validate(ids(1, 2, 49152, -1))
