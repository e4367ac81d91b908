"""The client side of router/auth.py: channels that reach a router with TLS and an API key (pdserve-client,
pdserve-bench-serving). The key rides on every call as `authorization: Bearer KEY` (a channel interceptor), so
callers make calls as on a plain channel.

NOTE: no torch here.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from pdserve.router.auth import API_KEY_ENV, SecurityError, read_api_keys


@dataclass(frozen=True)
class ClientAuth:
    """How a client reaches a secured router: the CA that signed its certificate, its own certificate, a key."""

    tls_ca: str | None = None
    """PEM CA bundle that signed the router's certificate; set: connect with TLS."""
    tls_cert: str | None = None
    """PEM client certificate (a router with --tls-client-ca asks for one)."""
    tls_key: str | None = None
    """PEM private key of tls_cert."""
    api_key: str | None = field(default=None, repr=False)
    """Sent as `authorization: Bearer KEY` on every call."""

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials, or None for a plaintext channel."""
        if self.tls_ca is None:
            return None
        cert = None if self.tls_cert is None else _read(self.tls_cert)
        key = None if self.tls_key is None else _read(self.tls_key)
        return grpc.ssl_channel_credentials(_read(self.tls_ca), key, cert)

    def aio_channel(self, address: str, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
        creds = self.credentials()
        interceptors = [] if self.api_key is None else _aio_bearers(self.api_key)
        if creds is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)

    def channel(self, address: str) -> grpc.Channel:
        creds = self.credentials()
        channel = grpc.insecure_channel(address) if creds is None else grpc.secure_channel(address, creds)
        return channel if self.api_key is None else grpc.intercept_channel(channel, _SyncBearer(self.api_key))


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"TLS file: {exc}") from None


def _with_key(metadata: Any, key: str) -> list[tuple[str, str]]:
    return [*(metadata or ()), ("authorization", f"Bearer {key}")]


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _SyncBearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, key: str) -> None:
        self.key = key

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = _with_key(d.metadata, self.key)
        compression = getattr(d, "compression", None)
        return _Details(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, compression)  # type: ignore[return-value]

    def intercept_unary_unary(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _AioBearer:
    """Base of the aio interceptors. NOTE: grpc.aio files an interceptor under the first call kind it matches,
    so each kind needs an interceptor of its own (_aio_bearers)."""

    def __init__(self, key: str) -> None:
        self.key = key

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*_with_key(d.metadata, self.key))
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


class _AioUnaryUnary(_AioBearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioBearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioBearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AioStreamStream(_AioBearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def _aio_bearers(key: str) -> list[grpc.aio.ClientInterceptor]:
    return [cls(key) for cls in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


def add_client_args(p: argparse.ArgumentParser) -> None:
    """The flags of a client that reaches a secured router."""
    p.add_argument("--tls-ca", default=None, help="PEM CA of the router's certificate: connect with TLS")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate (a router with --tls-client-ca)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--api-key-file", default=None, help=f"file whose first key is sent (else ${API_KEY_ENV})")


def client_auth(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> ClientAuth:
    """ClientAuth of add_client_args' flags; SecurityError for an unreadable or empty key file."""
    keys = read_api_keys(args.api_key_file, env)
    return ClientAuth(args.tls_ca, args.tls_cert, args.tls_key, keys[0] if keys else None)
