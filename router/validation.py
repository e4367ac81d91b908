"""GenerateRequest -> prompt token ids + core.messages.Sampling, or ValidationError (gRPC INVALID_ARGUMENT).

The sampling rules are the engine's own (core.sampling_params.SamplingParams.validate), so a request
that passes here is never refused by a worker; the prompt rules mirror core.engine's add_request. Sizes are
checked first (router/limits.py), before anything is converted or tokenized.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pdserve.core.errors import InvalidRequestError
from pdserve.core.messages import Sampling
from pdserve.core.sampling_params import SamplingParams
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.router.limits import LIMITS, RequestLimits
from pdserve.router.model_info import ModelSpec
from pdserve.router.tokenizer import ChatTemplateError, RouterTokenizer

DEFAULTS = SamplingParams()


class ValidationError(ValueError):
    """A request refused as given; the message names the field."""


class ValidRequest(NamedTuple):
    token_ids: np.ndarray
    """[num_tokens] int64: the prompt, one array from here to the GenerateCmd (hashing, packing, migration)."""
    sampling: Sampling
    stop: tuple[str, ...]
    """Stop strings (the router applies them; workers never see them)."""


class RequestValidator:
    """Checks and converts requests against one model's limits."""

    def __init__(self, model: ModelSpec, tokenizer: RouterTokenizer, limits: RequestLimits = LIMITS) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.limits = limits

    def validate(self, request: pb.GenerateRequest) -> ValidRequest:
        check_sizes(request, self.limits, self.model.max_model_len)
        token_ids = self.prompt_ids(request)
        self.check_prompt(token_ids)
        room = self.model.max_model_len - len(token_ids)
        params = sampling_params(request.sampling, room)
        try:
            params.validate(self.model.vocab_size)
        except InvalidRequestError as exc:
            raise ValidationError(str(exc)) from None
        if params.max_tokens > room:
            raise ValidationError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context "
                f"length ({self.model.max_model_len})"
            )
        stop = tuple(request.sampling.stop)
        if any(not s for s in stop):
            raise ValidationError("stop strings must be non-empty")
        return ValidRequest(token_ids, Sampling.of(params), stop)

    def prompt_ids(self, request: pb.GenerateRequest) -> np.ndarray:  # [num_tokens] int64
        # an array straight from the upb container: a list would cost again in the range check, the block hashes
        # and the packing
        return np.array(self._prompt(request), dtype=np.int64)

    def _prompt(self, request: pb.GenerateRequest) -> Sequence[int]:
        kind = request.WhichOneof("input")
        if kind == "token_ids":
            self.check_length(len(request.token_ids.ids))  # before a long list becomes an array
            return request.token_ids.ids
        if kind == "text":
            return self.tokenizer.encode(request.text) if request.text else []
        if kind == "chat":
            if not request.chat.messages:
                return []
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            try:
                return self.tokenizer.encode_chat(messages)
            except ChatTemplateError as exc:
                raise ValidationError(str(exc)) from None
        return []

    def check_prompt(self, token_ids: np.ndarray) -> None:
        self.check_length(len(token_ids))
        vocab = self.model.vocab_size
        outside = (token_ids < 0) | (token_ids >= vocab)
        if not outside.any():
            return
        bad = int(np.flatnonzero(outside)[0])
        raise ValidationError(f"token id {token_ids[bad]} at position {bad} outside the vocabulary [0, {vocab})")

    def check_length(self, num_tokens: int) -> None:
        if num_tokens == 0:
            raise ValidationError("empty prompt: set text, token_ids or chat")
        max_len = self.model.max_model_len
        if num_tokens >= max_len:
            raise ValidationError(
                f"prompt of {num_tokens} tokens leaves no room in the model's context length ({max_len})"
            )


def sampling_params(p: pb.SamplingParams, room: int) -> SamplingParams:
    """The engine's SamplingParams; unset optional fields take the engine's defaults, except max_tokens: unset, it
    is `room` (the context length minus the prompt), as in vLLM: generation ends at EOS or the context's end."""
    return SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else DEFAULTS.temperature,
        top_k=p.top_k if p.HasField("top_k") else DEFAULTS.top_k,
        top_p=p.top_p if p.HasField("top_p") else DEFAULTS.top_p,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens if p.HasField("max_tokens") else room,
        min_tokens=p.min_tokens if p.HasField("min_tokens") else DEFAULTS.min_tokens,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
    )


def check_sizes(request: pb.GenerateRequest, limits: RequestLimits, max_model_len: int) -> None:
    """ValidationError naming the limit when a string or repeated field is over it (router/limits.py)."""
    _check("request_id", len(request.request_id.encode()), "bytes", limits.max_request_id_bytes)
    sampling = request.sampling
    _check("stop", len(sampling.stop), "strings", limits.max_stop_strings)
    _check("stop", sum(len(s.encode()) for s in sampling.stop), "bytes in all", limits.max_stop_bytes)
    _check("stop_token_ids", len(sampling.stop_token_ids), "ids", limits.max_stop_token_ids)
    max_bytes = limits.max_prompt_bytes(max_model_len)
    why = f"{limits.prompt_bytes_per_token} bytes per token of the {max_model_len}-token context"
    kind = request.WhichOneof("input")
    if kind == "text":
        _check("text", len(request.text.encode()), "bytes", max_bytes, why)
    elif kind == "chat":
        messages = request.chat.messages
        _check("chat", len(messages), "messages", limits.max_chat_messages)
        num_bytes = sum(len(m.role.encode()) + len(m.content.encode()) for m in messages)
        _check("chat", num_bytes, "bytes of roles and contents", max_bytes, why)


def _check(field: str, size: int, unit: str, limit: int, why: str = "") -> None:
    if size > limit:
        raise ValidationError(f"{field}: {size} {unit}, over the limit of {limit}" + (f" ({why})" if why else ""))
