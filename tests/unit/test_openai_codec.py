"""OpenAI JSON <-> the request path's protobufs (router/openai_request.py, router/openai_response.py), on
hand-built GenerateResponses: logprobs both ways, chunks, whole responses."""

from __future__ import annotations

import json

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.router.openai_request import ApiRequest, Kind, parse_request
from pdserve.router.openai_response import MIN_LOGPROB, ResponseRenderer
from pdserve.router.tokenizer import RouterTokenizer

MODEL = "SmolLM2-135M-Instruct"


def parse(kind: Kind, **body: object) -> ApiRequest:
    return parse_request(kind, json.dumps(body).encode(), MODEL, "id-1")


def responses(tokenizer: RouterTokenizer) -> list[pb.GenerateResponse]:
    """Two responses of " Hello world" with logprobs and two alternatives per token."""
    hello, world = tokenizer.encode(" Hello")[0], tokenizer.encode(" world")[0]
    alt = tokenizer.encode(" Hi")[0]

    def lp(chosen: int, logprob: float) -> pb.Logprobs:
        top = [pb.TokenLogprob(token_id=chosen, logprob=logprob), pb.TokenLogprob(token_id=alt, logprob=-3.0)]
        return pb.Logprobs(logprob=logprob, top=top)

    first = pb.GenerateResponse(token_ids=[hello], text=" Hello", logprobs=[lp(hello, -0.5)], request_id="id-1")
    last = pb.GenerateResponse(token_ids=[world], text=" world", logprobs=[lp(world, float("-inf"))],
                               finish_reason=pb.FINISH_REASON_STOP, request_id="id-1")  # fmt: skip
    last.usage.CopyFrom(pb.Usage(prompt_tokens=4, completion_tokens=2, cached_prompt_tokens=1))
    return [first, last]


def test_logprobs_fields_map_to_sampling() -> None:
    s = parse("completion", prompt="x", logprobs=3).request.sampling
    assert (s.logprobs, s.top_logprobs) == (True, 3)
    s = parse("completion", prompt="x", logprobs=None).request.sampling
    assert (s.logprobs, s.top_logprobs) == (False, 0)
    s = parse("chat", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=5).request.sampling
    assert (s.logprobs, s.top_logprobs) == (True, 5)
    s = parse("chat", messages=[{"role": "user", "content": "x"}], logprobs=False).request.sampling
    assert (s.logprobs, s.top_logprobs) == (False, 0)


def test_completion_logprobs_have_tokens_offsets_and_the_chosen_token_among_the_top(
    tokenizer: RouterTokenizer,
) -> None:
    renderer = ResponseRenderer(parse("completion", prompt="x", logprobs=2), MODEL, tokenizer, 7)
    whole = renderer.whole(responses(tokenizer))
    (choice,) = whole["choices"]
    assert (choice["text"], choice["finish_reason"]) == (" Hello world", "stop")
    assert choice["logprobs"] == {
        "tokens": [" Hello", " world"],
        "token_logprobs": [-0.5, MIN_LOGPROB],
        "top_logprobs": [{" Hello": -0.5, " Hi": -3.0}, {" world": MIN_LOGPROB, " Hi": -3.0}],
        "text_offset": [0, 6],
    }
    assert whole["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                              "prompt_tokens_details": {"cached_tokens": 1}}  # fmt: skip
    assert (whole["id"], whole["object"], whole["created"], whole["model"]) == ("id-1", "text_completion", 7, MODEL)


def test_chat_stream_chunks_carry_each_tokens_logprobs(tokenizer: RouterTokenizer) -> None:
    api = parse("chat", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2, stream=True)
    renderer = ResponseRenderer(api, MODEL, tokenizer, 7)
    (role,) = renderer.first_chunks()
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""} and "usage" not in role
    first, last = (renderer.chunks(r) for r in responses(tokenizer))
    (chunk,) = first
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["finish_reason"] is None
    assert chunk["choices"][0]["logprobs"] == {
        "content": [{"token": " Hello", "logprob": -0.5, "bytes": list(b" Hello"),
                     "top_logprobs": [{"token": " Hello", "logprob": -0.5, "bytes": list(b" Hello")},
                                      {"token": " Hi", "logprob": -3.0, "bytes": list(b" Hi")}]}],
        "refusal": None,
    }  # fmt: skip
    (end,) = last  # NOTE: no usage chunk without stream_options.include_usage
    assert end["choices"][0]["delta"] == {"content": " world"} and end["choices"][0]["finish_reason"] == "stop"


def test_usage_chunk_follows_the_last_only_with_include_usage(tokenizer: RouterTokenizer) -> None:
    api = parse("completion", prompt="x", stream=True, stream_options={"include_usage": True})
    renderer = ResponseRenderer(api, MODEL, tokenizer, 7)
    first, last = (renderer.chunks(r) for r in responses(tokenizer))
    assert [c["usage"] for c in first] == [None] and first[0]["choices"][0]["logprobs"] is None
    assert [c["choices"] for c in last][1] == [] and last[1]["usage"]["total_tokens"] == 6
    quiet = renderer.chunks(pb.GenerateResponse(token_ids=[5]))  # NOTE: a token whose text is held back
    assert quiet == []


def test_whole_chat_is_a_message(tokenizer: RouterTokenizer) -> None:
    renderer = ResponseRenderer(parse("chat", messages=[{"role": "user", "content": "x"}]), MODEL, tokenizer, 7)
    (choice,) = renderer.whole(responses(tokenizer))["choices"]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": " Hello world"}, "logprobs": None,
                      "finish_reason": "stop"}  # fmt: skip


def test_return_token_ids_puts_ids_in_every_choice_and_streams_tokens_that_have_no_text(
    tokenizer: RouterTokenizer,
) -> None:
    """vLLM's return_token_ids: a response whose tokens have no text yet (a partial UTF-8 character, an id past
    the tokenizer's) is still a chunk, so a client counts every token; without it such a response sends nothing."""
    silent = pb.GenerateResponse(token_ids=[7, 8], text="", request_id="id-1")
    plain = ResponseRenderer(parse("completion", prompt="x", stream=True), MODEL, tokenizer, 7)
    assert plain.chunks(silent) == []
    api = parse("completion", prompt="x", stream=True, return_token_ids=True)
    assert api.return_token_ids
    ids = ResponseRenderer(api, MODEL, tokenizer, 7)
    ((choice,),) = [c["choices"] for c in ids.chunks(silent)]
    assert (choice["text"], choice["token_ids"]) == ("", [7, 8])
    chat = ResponseRenderer(parse("chat", messages=[{"role": "user", "content": "x"}], return_token_ids=True), MODEL,
                            tokenizer, 7)  # fmt: skip
    (whole,) = chat.whole(responses(tokenizer))["choices"]
    assert whole["token_ids"] == [t for r in responses(tokenizer) for t in r.token_ids]
    assert whole["message"]["content"] == " Hello world"
