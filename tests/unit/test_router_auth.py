"""Security at the router's edge (router/auth.py): API keys, TLS with and without client certificates, the
refusal to listen beyond loopback unauthenticated; through the real router with fake workers, over gRPC and the
OpenAI-compatible HTTPS API."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.router import __main__ as router_main
from pdserve.router import cluster_cli
from pdserve.router.auth import (
    API_KEY_ENV,
    DENIED,
    EdgeSecurity,
    SecurityError,
    exposure_error,
    read_api_keys,
    uvicorn_tls,
)
from pdserve.router.cli import build_parser, router_args_error
from pdserve.router.client_auth import ClientAuth
from pdserve.router.cluster_flags import ArgvError
from tests.router_fakes import Script, router_with_fakes
from tests.tls_certs import TlsFiles, make_tls_files

KEY = "k-0123456789abcdef"
MODEL = "SmolLM2-135M-Instruct"
REQUEST = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(max_tokens=3))


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def test_bearer_ok_accepts_only_a_configured_key() -> None:
    sec = EdgeSecurity(api_keys=(KEY, "other"))
    assert sec.bearer_ok(f"Bearer {KEY}") and sec.bearer_ok(f"bearer {KEY}") and sec.bearer_ok("Bearer other")
    for header in (None, "", KEY, f"Bearer {KEY}x", "Bearer ", f"Basic {KEY}"):
        assert not sec.bearer_ok(header), header
    assert EdgeSecurity().bearer_ok(None)  # NOTE: no keys configured: nothing is asked for
    assert KEY not in repr(sec)


def test_api_keys_come_from_the_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# keys\n{KEY}\n\n  second  \n")
    assert read_api_keys(str(path), {API_KEY_ENV: " third "}) == (KEY, "second", "third")
    assert read_api_keys(None, {}) == ()
    path.write_text("# none\n")
    with pytest.raises(SecurityError, match="no key"):
        read_api_keys(str(path), {})
    with pytest.raises(SecurityError, match="--api-key-file"):
        read_api_keys(str(tmp_path / "missing"), {})


def _args_error(argv: list[str]) -> str | None:
    return router_args_error(build_parser().parse_args(["--model", "m", "--run-dir", "r", *argv]))


def test_binding_beyond_loopback_needs_client_authentication(
    tls: TlsFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    keys = tmp_path / "keys"
    keys.write_text(KEY)
    server_tls = ["--tls-cert", str(tls.server_cert), "--tls-key", str(tls.server_key)]
    for bind in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert _args_error(["--bind", bind]) is None
    for bind in ("0.0.0.0", "::", "10.1.2.3", "router.example"):
        assert "reachable from other hosts" in str(_args_error(["--bind", bind]))
    assert "reachable from other hosts" in str(_args_error(["--bind", "0.0.0.0", *server_tls]))  # NOTE: no auth
    assert _args_error(["--bind", "0.0.0.0", "--api-key-file", str(keys)]) is None
    assert _args_error(["--bind", "0.0.0.0", *server_tls, "--tls-client-ca", str(tls.ca)]) is None
    assert _args_error(["--bind", "0.0.0.0", "--insecure"]) is None
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert _args_error(["--bind", "0.0.0.0"]) is None
    assert _args_error(["--tls-cert", str(tls.server_cert)]) == "--tls-cert and --tls-key go together"
    assert "needs --tls-cert" in str(_args_error(["--tls-client-ca", str(tls.ca)]))
    assert "no such file" in str(_args_error(["--tls-cert", "/nonexistent", "--tls-key", str(tls.server_key)]))


def test_the_router_process_refuses_an_open_bind(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(SystemExit) as exc:
        router_main.parse_args(["--model", "m", "--run-dir", "r", "--bind", "0.0.0.0"])
    assert exc.value.code == 2
    assert "--bind 0.0.0.0 is reachable from other hosts" in capsys.readouterr().err
    assert exposure_error("0.0.0.0", EdgeSecurity(insecure=True)) is None


def test_uvicorn_tls_settings(tls: TlsFiles) -> None:
    assert uvicorn_tls(EdgeSecurity()) == {}
    sec = EdgeSecurity(str(tls.server_cert), str(tls.server_key), str(tls.ca))
    assert uvicorn_tls(sec) == {"ssl_certfile": str(tls.server_cert), "ssl_keyfile": str(tls.server_key),
                                "ssl_ca_certs": str(tls.ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}  # fmt: skip


async def _generate(auth: ClientAuth, address: str) -> grpc.StatusCode:
    """The status of one Generate call (tokens checked when OK)."""
    async with auth.aio_channel(address) as channel:
        try:
            got = [r async for r in pb_grpc.GenerationStub(channel).Generate(REQUEST)]
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                assert exc.details() == DENIED
            return exc.code()
    assert [t for r in got for t in r.token_ids] == [7, 8, 9]
    return grpc.StatusCode.OK


def _sync_tokens(auth: ClientAuth, address: str) -> list[int]:
    """Generate over auth's blocking channel (pdserve-client's)."""
    with auth.channel(address) as channel:
        return [t for r in pb_grpc.GenerationStub(channel).Generate(REQUEST) for t in r.token_ids]


async def _open_calls(auth: ClientAuth, address: str) -> tuple[int, grpc.StatusCode]:
    """(health status without a key, the status of a reflection call as auth)."""
    async with auth.aio_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        try:
            [_ async for _ in stub.ServerReflectionInfo(iter([request]))]
            code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
    return int(reply.status), code


def test_tls_and_api_key_no_key_wrong_key_right_key(smollm2_dir: Path, run_dir: Path, tls: TlsFiles) -> None:
    sec = EdgeSecurity(str(tls.server_cert), str(tls.server_key), api_keys=(KEY,))

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([7, 8, 9]), security=sec) as h:
            address = f"localhost:{h.router.port}"
            ca = str(tls.ca)
            assert await _generate(ClientAuth(ca), address) == grpc.StatusCode.UNAUTHENTICATED
            assert await _generate(ClientAuth(ca, api_key="wrong"), address) == grpc.StatusCode.UNAUTHENTICATED
            assert await _generate(ClientAuth(ca, api_key=KEY), address) == grpc.StatusCode.OK
            assert await asyncio.to_thread(_sync_tokens, ClientAuth(ca, api_key=KEY), address) == [7, 8, 9]
            assert await _generate(ClientAuth(api_key=KEY), address) == grpc.StatusCode.UNAVAILABLE  # NOTE: plaintext
            assert await _open_calls(ClientAuth(ca), address) == (1, grpc.StatusCode.UNAUTHENTICATED)
            assert await _open_calls(ClientAuth(ca, api_key=KEY), address) == (1, grpc.StatusCode.OK)

    asyncio.run(body())


def test_a_client_ca_requires_client_certificates(smollm2_dir: Path, run_dir: Path, tls: TlsFiles) -> None:
    sec = EdgeSecurity(str(tls.server_cert), str(tls.server_key), str(tls.ca))

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([7, 8, 9]), security=sec) as h:
            address = f"localhost:{h.router.port}"
            ca = str(tls.ca)
            assert await _generate(ClientAuth(ca), address) == grpc.StatusCode.UNAVAILABLE
            with_cert = ClientAuth(ca, str(tls.client_cert), str(tls.client_key))
            assert await _generate(with_cert, address) == grpc.StatusCode.OK

    asyncio.run(body())


def _https_context(tls: TlsFiles, with_cert: bool = False) -> ssl.SSLContext:
    """A client context that trusts the test CA, presenting the client certificate when with_cert."""
    context = ssl.create_default_context(cafile=str(tls.ca))
    if with_cert:
        context.load_cert_chain(str(tls.client_cert), str(tls.client_key))
    return context


def _sdk(url: str, context: ssl.SSLContext, api_key: str) -> Any:
    """An AsyncOpenAI client of the router's HTTPS API (Any: the SDK's request types list OpenAI's models only)."""
    http = openai.DefaultAsyncHttpxClient(verify=context)
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, http_client=http)


async def _post(url: str, context: ssl.SSLContext | None, body: dict[str, Any]) -> tuple[int, Any]:
    """One POST without an Authorization header; the status and the JSON body."""
    async with aiohttp.ClientSession() as session, session.post(url, json=body, ssl=context or False) as reply:
        return reply.status, await reply.json()


def test_https_and_api_key_no_key_wrong_key_right_key(smollm2_dir: Path, run_dir: Path, tls: TlsFiles) -> None:
    sec = EdgeSecurity(str(tls.server_cert), str(tls.server_key), api_keys=(KEY,))
    request = {"model": MODEL, "prompt": "x", "max_tokens": 3}

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([7, 8, 9]), http_port=0, security=sec) as h:
            url = str(h.router.http_url)
            assert url.startswith("https://")
            context = _https_context(tls)
            status, err = await _post(url + "/v1/completions", context, request)
            assert status == 401 and err["error"]["code"] == "invalid_api_key"
            assert err["error"]["type"] == "invalid_request_error"
            with pytest.raises(openai.AuthenticationError) as denied:
                await _sdk(url, context, "wrong").completions.create(**request)
            assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"
            got = await _sdk(url, context, KEY).completions.create(**request)
            assert got.usage.completion_tokens == 3 and got.choices[0].finish_reason == "length"
            with pytest.raises(aiohttp.ClientError):  # NOTE: plaintext to the TLS port
                await _post(url.replace("https://", "http://") + "/v1/completions", None, request)

    asyncio.run(body())


def test_https_with_a_client_ca_refuses_clients_without_a_certificate(
    smollm2_dir: Path, run_dir: Path, tls: TlsFiles
) -> None:
    sec = EdgeSecurity(str(tls.server_cert), str(tls.server_key), str(tls.ca))
    request = {"model": MODEL, "prompt": "x", "max_tokens": 3}

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([7, 8, 9]), http_port=0, security=sec) as h:
            url = str(h.router.http_url)
            with pytest.raises(aiohttp.ClientError):
                await _post(url + "/v1/completions", _https_context(tls), request)
            with pytest.raises(openai.APIConnectionError):
                await _sdk(url, _https_context(tls), "none").completions.create(**request)
            got = await _sdk(url, _https_context(tls, with_cert=True), "none").completions.create(**request)
            assert got.usage.completion_tokens == 3

    asyncio.run(body())


def test_the_launcher_hands_the_security_flags_to_the_router_and_refuses_an_open_bind(
    tls: TlsFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    parser = cluster_cli.build_parser()
    args, rest = cluster_cli.parse_args(parser, ["--model", "m", "--bind", "0.0.0.0"])
    with pytest.raises(ArgvError, match="--bind 0.0.0.0 is reachable from other hosts"):
        cluster_cli.plan_cluster(args, rest, tmp_path)
    keys = tmp_path / "keys"
    keys.write_text(KEY)
    flags = ["--tls-cert", str(tls.server_cert), "--tls-key", str(tls.server_key), "--api-key-file", str(keys)]
    args, rest = cluster_cli.parse_args(parser, ["--model", "m", "--bind", "0.0.0.0", *flags])
    router, *workers = cluster_cli.plan_cluster(args, rest, tmp_path).children
    assert router.argv[-len(flags) :] == flags
    assert all("--api-key-file" not in w.argv and "--tls-cert" not in w.argv for w in workers)
