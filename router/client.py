"""`pdserve-client`: stream one generation from a pdserve router to the terminal.

    pdserve-client --address 127.0.0.1:50051 "Tell me a joke"
    pdserve-client --chat --max-tokens 64 --temperature 0 "Tell me a joke"
    pdserve-client --temperature 0 --logprobs 5 "Tell me a joke"

Text goes to stdout as it arrives; usage and timings (and with --logprobs each token's) go to stderr at the end.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

import grpc

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.router.client_auth import add_client_args, client_auth

FINISH_NAMES = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in pb.FinishReason.items()}


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
    if args.logprobs is not None:
        sampling.logprobs = True
        sampling.top_logprobs = args.logprobs
    for name in ("temperature", "top_k", "top_p", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    if args.chat:
        messages = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
        messages.append(pb.ChatMessage(role="user", content=args.prompt))
        return pb.GenerateRequest(chat=pb.ChatMessages(messages=messages), sampling=sampling)
    return pb.GenerateRequest(text=args.prompt, sampling=sampling)


def stream(
    stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, out: TextIO,
    logprobs: list[tuple[int, pb.Logprobs]] | None = None,
) -> pb.GenerateResponse | None:  # fmt: skip
    """Write each text delta to out as it arrives; the last response. logprobs: gets each token with its
    Logprobs, when the request asked for them."""
    last = None
    call = stub.Generate(request)
    try:
        for response in call:
            out.write(response.text)
            out.flush()
            if logprobs is not None:
                logprobs += zip(response.token_ids, response.logprobs, strict=True)
            last = response
    except KeyboardInterrupt:
        call.cancel()
        raise
    return last


def summary(last: pb.GenerateResponse) -> str:
    u, t = last.usage, last.timings
    return (
        f"[{FINISH_NAMES.get(last.finish_reason, '?')}] prompt {u.prompt_tokens} tokens "
        f"({u.cached_prompt_tokens} cached), completion {u.completion_tokens} tokens; "
        f"first token {t.first_token_ms:.1f} ms (queue {t.queue_ms:.1f}, prefill {t.prefill_ms:.1f}, "
        f"handoff {t.handoff_ms:.1f}); request {last.request_id}"
    )


def format_logprobs(tokens: list[tuple[int, pb.Logprobs]]) -> str:
    """One line per token: its id and logprob, then the top alternatives as id:logprob."""
    lines = []
    for token_id, lp in tokens:
        top = " ".join(f"{t.token_id}:{t.logprob:.4f}" for t in lp.top)
        lines.append(f"{token_id:>8} {lp.logprob:10.4f}  {top}".rstrip())
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve-client", description="Stream a generation from a pdserve router.")
    p.add_argument("prompt")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, metavar="N", help="print each token's logprob and top N")
    p.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    add_client_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with client_auth(args).channel(args.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            if args.timeout is not None:
                grpc.channel_ready_future(channel).result(timeout=args.timeout)
            tokens: list[tuple[int, pb.Logprobs]] | None = None if args.logprobs is None else []
            last = stream(stub, build_request(args), sys.stdout, tokens)
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except grpc.FutureTimeoutError:
            print(f"error: no router at {args.address} within {args.timeout}s", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    print(file=sys.stdout)
    if tokens:
        print(format_logprobs(tokens), file=sys.stderr)
    if last is not None:
        print(summary(last), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
