"""OpenAI request bodies (/v1/completions, /v1/chat/completions) -> pb.GenerateRequest, or ApiError naming the
field in OpenAI's error shape.

Here only what OpenAI's JSON adds is checked: types, field names, what pdserve does not do (n > 1, penalties,
tools, ...). Ranges and limits stay with the request path's validator (router/validation.py), the same for gRPC
and HTTP. Every field may be null, meaning unset.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb

Kind = Literal["completion", "chat"]
INT32 = (-(2**31), 2**31)
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "min_tokens",
                   "ignore_eos")  # fmt: skip
COMMON_FIELDS = frozenset({*SAMPLING_FIELDS, "model", "user", "n", "stream", "stream_options", "return_token_ids"})
FIELDS: dict[Kind, frozenset[str]] = {
    "completion": COMMON_FIELDS | {"prompt", "logprobs"},
    "chat": COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "parallel_tool_calls"},
}
"""The fields each endpoint reads."""
NEUTRAL: dict[Kind, Mapping[str, tuple[Any, ...]]] = {
    "completion": {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
                   "logit_bias": ({},), "best_of": (1,), "echo": (False,), "suffix": ("",)},
    "chat": {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
             "tools": ([],), "tool_choice": ("none", "auto"), "response_format": ({"type": "text"},)},
}  # fmt: skip
"""Fields pdserve does not implement, accepted only with these values (which change nothing)."""


class ApiError(Exception):
    """A request refused in OpenAI's shape: HTTP status, message, the offending field and an error code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass(frozen=True)
class ApiRequest:
    """One parsed OpenAI request: the request path's request and what the response's shape depends on."""

    kind: Kind
    request: pb.GenerateRequest
    stream: bool
    include_usage: bool
    """stream_options.include_usage: a last chunk with the usage and no choices."""
    return_token_ids: bool = False
    """vLLM's extension: every choice also carries its `token_ids` (a chunk per response, even without text)."""


def parse_request(kind: Kind, body: bytes, model_name: str, request_id: str) -> ApiRequest:
    """The body of a POST to kind's endpoint as a request with id request_id; ApiError (400, or 404 for another
    model) naming the field."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the body must be a JSON object")
    fields = {k: v for k, v in obj.items() if v is not None}
    _check_fields(kind, fields)
    model = fields.get("model")
    if model is not None and _str("model", model) != model_name:
        raise ApiError(404, f"The model `{model}` does not exist (this server serves `{model_name}`).", "model",
                       "model_not_found")  # fmt: skip
    if _int("n", fields.get("n", 1)) != 1:
        raise ApiError(400, "n > 1 is not supported: send one request per completion", "n")
    stream = _bool("stream", fields.get("stream", False))
    include_usage = _stream_options(fields.get("stream_options"), stream)
    request = pb.GenerateRequest(request_id=request_id, sampling=_sampling(kind, fields))
    if kind == "chat":
        request.chat.CopyFrom(_messages(fields.get("messages")))
    else:
        _prompt(fields.get("prompt"), request)
    _str("user", fields.get("user", ""))
    return_ids = _bool("return_token_ids", fields.get("return_token_ids", False))
    return ApiRequest(kind, request, stream, include_usage, return_ids)


def _check_fields(kind: Kind, fields: Mapping[str, Any]) -> None:
    for name, value in fields.items():
        if name in FIELDS[kind]:
            continue
        neutral = NEUTRAL[kind].get(name)
        if neutral is None:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", name)
        if value not in neutral:
            allowed = " or ".join(json.dumps(v) for v in neutral)
            raise ApiError(400, f"{name} is not supported (only {allowed})", name)


def _sampling(kind: Kind, fields: Mapping[str, Any]) -> pb.SamplingParams:
    p = pb.SamplingParams()
    max_tokens = fields.get("max_completion_tokens", fields.get("max_tokens"))
    if max_tokens is not None:
        p.max_tokens = _int("max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens", max_tokens)
    for name in ("temperature", "top_p"):
        if name in fields:
            setattr(p, name, _number(name, fields[name]))
    if "top_k" in fields:
        p.top_k = max(_int("top_k", fields["top_k"], -1), 0)  # NOTE: -1 is vLLM's "all tokens", like 0
    if "seed" in fields:
        p.seed = _int("seed", fields["seed"], 0, 2**63)
    if "min_tokens" in fields:
        p.min_tokens = _int("min_tokens", fields["min_tokens"])
    stop = fields.get("stop", [])
    p.stop.extend([stop] if isinstance(stop, str) else _list("stop", stop, _str))
    p.stop_token_ids.extend(_list("stop_token_ids", fields.get("stop_token_ids", []), _int))
    p.ignore_eos = _bool("ignore_eos", fields.get("ignore_eos", False))
    _logprobs(kind, fields, p)
    return p


def _logprobs(kind: Kind, fields: Mapping[str, Any], p: pb.SamplingParams) -> None:
    """completions: logprobs N (the chosen token and the N most likely); chat: logprobs true + top_logprobs N."""
    if kind == "completion":
        if "logprobs" in fields:
            p.logprobs, p.top_logprobs = True, _int("logprobs", fields["logprobs"], 0)
        return
    p.logprobs = _bool("logprobs", fields.get("logprobs", False))
    if "top_logprobs" in fields:
        if not p.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        p.top_logprobs = _int("top_logprobs", fields["top_logprobs"], 0)


def _stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, 'stream_options must be an object with only "include_usage"', "stream_options")
    return _bool("stream_options.include_usage", options.get("include_usage", False))


def _prompt(prompt: Any, request: pb.GenerateRequest) -> None:
    """A string, token ids, or a list of exactly one of either."""
    if prompt is None:
        raise ApiError(400, "prompt is required", "prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        if len(prompt) > 1:
            raise ApiError(400, "several prompts in one request are not supported: send one request each", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, list) and prompt:
        request.token_ids.ids.extend(_list("prompt", prompt, _int))
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids or a list of one of them", "prompt")


def _messages(messages: Any) -> pb.ChatMessages:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = pb.ChatMessages()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object", where)
        role = _str(f"{where}.role", message.get("role"))
        out.messages.add(role=role, content=_content(f"{where}.content", message.get("content")))
    return out


def _content(where: str, content: Any) -> str:
    """A message's text: a string, null (e.g. an assistant turn of tool calls) or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ApiError(400, f"{where}[{j}]: only parts of type text are supported", f"{where}[{j}]")
        texts.append(_str(f"{where}[{j}].text", part.get("text")))
    return "".join(texts)


def _int(name: str, value: Any, lo: int = INT32[0], hi: int = INT32[1]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {json.dumps(value)}", name)
    if not lo <= value < hi:
        raise ApiError(400, f"{name} must be in [{lo}, {hi}), got {value}", name)
    return value


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"{name} must be a number, got {json.dumps(value)}", name)
    return float(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {json.dumps(value)}", name)
    return value


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string, got {json.dumps(value)}", name)
    return value


def _list(name: str, value: Any, item: Callable[[str, Any], Any]) -> list[Any]:
    if not isinstance(value, list):
        raise ApiError(400, f"{name} must be a list", name)
    return [item(name, v) for v in value]
