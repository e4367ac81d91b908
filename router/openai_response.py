"""pb.GenerateResponse -> OpenAI's response objects: completions and chat completions, whole or as stream chunks
(one chunk per response), usage, logprobs, and OpenAI's error body."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.router.openai_request import SAMPLING_FIELDS, ApiRequest, Kind
from pdserve.router.tokenizer import RouterTokenizer

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
"""OpenAI's finish_reason; "abort" (vLLM's) when the server gave up on the request."""
MIN_LOGPROB = -9999.0
"""Stands for -inf, which JSON cannot carry (vLLM's choice)."""
PROMPT_WORDS = frozenset({"prompt", "empty", "token", "text", "token_ids", "chat"})
"""First words of the request path's messages about the prompt (router/validation.py)."""


def param_of(message: str, kind: Kind) -> str | None:
    """The OpenAI field a request path's INVALID_ARGUMENT message is about (router/validation.py and the engine's
    SamplingParams.validate start with the field), None when it names none."""
    word = message.split(" ", 1)[0].rstrip(":")
    if message.startswith("stop token id"):
        return "stop_token_ids"
    if " + max_tokens " in message:
        return "max_tokens"
    if word in SAMPLING_FIELDS or word == "top_logprobs":
        return "logprobs" if word == "top_logprobs" and kind == "completion" else word
    return ("messages" if kind == "chat" else "prompt") if word in PROMPT_WORDS else None


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(u: pb.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


class ResponseRenderer:
    """The OpenAI objects of one request's responses (the request path's, in order)."""

    def __init__(self, api: ApiRequest, model: str, tokenizer: RouterTokenizer, created: int) -> None:
        self.api = api
        self.chat = api.kind == "chat"
        self.tokenizer = tokenizer
        self.logprobs = api.request.sampling.logprobs
        self.head = {"id": api.request.request_id, "created": created, "model": model}
        self.text_offset = 0
        """Characters of completion text before the next token (completions' logprobs.text_offset)."""

    def whole(self, responses: Sequence[pb.GenerateResponse]) -> dict[str, Any]:
        """The response object of a request that does not stream."""
        last = responses[-1] if responses else pb.GenerateResponse()
        merged = pb.GenerateResponse(text="".join(r.text for r in responses), finish_reason=last.finish_reason)
        for r in responses:
            merged.token_ids.extend(r.token_ids)
            merged.logprobs.extend(r.logprobs)
        choice = self._choice(merged)
        if self.chat:
            choice["message"] = {"role": "assistant", "content": choice.pop("delta")["content"]}
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self.head, "object": kind, "choices": [choice], "usage": usage(last.usage)}

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chunks before any token: chat's assistant role."""
        return [self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])] if self.chat else []  # fmt: skip

    def chunks(self, response: pb.GenerateResponse) -> list[dict[str, Any]]:
        """The stream chunks of one response: none when it changes nothing the client sees; the usage chunk
        after the last one when the client asked for it."""
        out = []
        shown = response.token_ids if self.api.return_token_ids else response.text
        if shown or response.finish_reason or (self.logprobs and response.logprobs):
            out.append(self._chunk([self._choice(response)]))
        if response.finish_reason and self.api.include_usage:
            out.append(self._chunk([], usage(response.usage)))
        return out

    def _chunk(self, choices: list[dict[str, Any]], used: dict[str, Any] | None = None) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {**self.head, "object": kind, "choices": choices}
        if self.api.include_usage:
            chunk["usage"] = used
        return chunk

    def _choice(self, r: pb.GenerateResponse) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": r.text}
        else:
            choice["text"] = r.text
        choice["logprobs"] = self._logprobs(r) if self.logprobs else None
        if self.api.return_token_ids:
            choice["token_ids"] = list(r.token_ids)
        choice["finish_reason"] = FINISH_REASONS.get(r.finish_reason)
        return choice

    def _logprobs(self, r: pb.GenerateResponse) -> dict[str, Any]:
        pairs = list(zip(r.token_ids, r.logprobs, strict=False))
        if self.chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in pairs], "refusal": None}
        tokens: list[str] = []
        offsets: list[int] = []
        tops: list[dict[str, float]] = []
        for token_id, lp in pairs:
            text = self._token(token_id)
            top = {self._token(t.token_id): _finite(t.logprob) for t in lp.top}
            top[text] = _finite(lp.logprob)  # NOTE: OpenAI's: the chosen token is always there (up to N + 1)
            tokens.append(text)
            offsets.append(self.text_offset)
            tops.append(top)
            self.text_offset += len(text)
        token_logprobs = [_finite(lp.logprob) for _, lp in pairs]
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _chat_entry(self, token_id: int, lp: pb.Logprobs) -> dict[str, Any]:
        entry = self._token_logprob(token_id, lp.logprob)
        entry["top_logprobs"] = [self._token_logprob(t.token_id, t.logprob) for t in lp.top]
        return entry

    def _token_logprob(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    def _token(self, token_id: int) -> str:
        """One token's text as the model's tokenizer writes it, special tokens included."""
        return str(self.tokenizer.tokenizer.decode([token_id], skip_special_tokens=False))


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
