"""Security at the router's edge: TLS (server certificate, optional client certificates) and API keys
(`authorization: Bearer KEY`) for gRPC, and the same check and TLS settings for an HTTP front end.

What is open without a key: grpc.health.v1 (Check, Watch), so that load balancers and Kubernetes probes, which
do not authenticate, can see the router. Everything else, server reflection included, needs the key.

Where keys come from: a file (--api-key-file, one key a line, # comments) and the PDSERVE_API_KEY environment
variable; never a command-line literal, which any local user could read in `ps`.

NOTE: no torch here: the router and the clients import this module.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

API_KEY_ENV = "PDSERVE_API_KEY"
"""Environment variable holding one API key (added to those of --api-key-file)."""
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
"""gRPC methods served without an API key."""
DENIED = "missing or invalid API key"
BEARER = "bearer "


@dataclass(frozen=True)
class EdgeSecurity:
    """How clients reach the router: TLS files and API keys (all off: plaintext, no keys, loopback only)."""

    tls_cert: str | None = None
    """PEM server certificate (chain); with tls_key, the router serves TLS only."""
    tls_key: str | None = None
    """PEM private key of tls_cert."""
    tls_client_ca: str | None = None
    """PEM CA bundle: when set, every client must present a certificate it signed (mutual TLS)."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Accepted bearer keys; empty: no key is asked for."""
    insecure: bool = False
    """Allow listening beyond loopback without client authentication (check_exposure)."""

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def authenticates(self) -> bool:
        """Whether a client must prove who it is: an API key or a client certificate."""
        return bool(self.api_keys) or self.tls_client_ca is not None

    def bearer_ok(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header (or gRPC metadata value) carries an accepted key; always True when no
        keys are configured. Compares in constant time against every key."""
        if not self.api_keys:
            return True
        if authorization is None or authorization[: len(BEARER)].lower() != BEARER:
            return False
        given = authorization[len(BEARER) :].strip().encode()
        return any([hmac.compare_digest(given, key.encode()) for key in self.api_keys])


class SecurityError(ValueError):
    """Edge security settings that cannot work or are not allowed; the message names the flag."""


def read_api_keys(path: str | None, env: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """Keys of the file at path (one a line; blank lines and # comments skipped) and of API_KEY_ENV."""
    keys: list[str] = []
    if path is not None:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise SecurityError(f"--api-key-file: {exc}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise SecurityError(f"--api-key-file {path}: no key in it")
    if env.get(API_KEY_ENV, "").strip():
        keys.append(env[API_KEY_ENV].strip())
    return tuple(keys)


def is_loopback(host: str) -> bool:
    """Whether a listen host is reachable from this machine only ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # NOTE: a host name may resolve to anything


def exposure_error(bind: str, sec: EdgeSecurity) -> str | None:
    """What forbids serving sec on bind, or None: incomplete TLS settings, or a bind beyond loopback whose clients
    are not authenticated (no API key, no client CA) without sec.insecure."""
    if (sec.tls_cert is None) != (sec.tls_key is None):
        return "--tls-cert and --tls-key go together"
    files = (("--tls-cert", sec.tls_cert), ("--tls-key", sec.tls_key), ("--tls-client-ca", sec.tls_client_ca))
    for flag, path in files:
        if path is not None and not Path(path).is_file():
            return f"{flag} {path}: no such file"
    if sec.tls_client_ca is not None and not sec.tls:
        return "--tls-client-ca needs --tls-cert and --tls-key"
    if is_loopback(bind) or sec.authenticates or sec.insecure:
        return None
    return (
        f"--bind {bind} is reachable from other hosts: give clients a key (--api-key-file or {API_KEY_ENV}) "
        "or require client certificates (--tls-client-ca), or pass --insecure to serve anyone who connects"
    )


def _log_exposure(bind: str, sec: EdgeSecurity) -> None:
    """A key without TLS beyond loopback is allowed (TLS may end at a proxy in front), but said."""
    if is_loopback(bind):
        return
    if sec.api_keys and not sec.tls:
        log.warning("API keys without TLS on %s: keys cross the network in clear unless a TLS proxy fronts it", bind)
    if not sec.authenticates:
        log.warning("--insecure: anyone who reaches %s may use the router", bind)


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"TLS file: {exc}") from None


def server_credentials(sec: EdgeSecurity) -> grpc.ServerCredentials:
    """gRPC TLS credentials of sec (tls must be on); client certificates required when a client CA is set."""
    assert sec.tls_cert is not None and sec.tls_key is not None
    ca = None if sec.tls_client_ca is None else _read(sec.tls_client_ca)
    pair = [(_read(sec.tls_key), _read(sec.tls_cert))]
    return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=ca is not None)


def add_port(server: grpc.aio.Server, bind: str, address: str, sec: EdgeSecurity) -> int:
    """Listen on address (host bind; TLS when sec says so); the port, 0 when it could not listen. SecurityError
    when exposure_error forbids it."""
    if (error := exposure_error(bind, sec)) is not None:
        raise SecurityError(error)
    _log_exposure(bind, sec)
    if sec.tls:
        return server.add_secure_port(address, server_credentials(sec))
    return server.add_insecure_port(address)


def interceptors(sec: EdgeSecurity) -> list[grpc.aio.ServerInterceptor]:
    """The server interceptors sec needs, outermost first (none without API keys)."""
    return [ApiKeyInterceptor(sec)] if sec.api_keys else []


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call but OPEN_METHODS with UNAUTHENTICATED unless its `authorization` metadata is an accepted
    bearer key; the servicer never sees a refused call."""

    def __init__(self, sec: EdgeSecurity) -> None:
        self.sec = sec

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in OPEN_METHODS:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.sec.bearer_ok(metadata.get("authorization")):
            return handler
        return _denying(handler)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of handler's kind that ends the call UNAUTHENTICATED before reading it."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(_deny, handler.request_deserializer, handler.response_serializer)  # type: ignore[operator]


def uvicorn_tls(sec: EdgeSecurity) -> dict[str, Any]:
    """uvicorn.run / uvicorn.Config keyword arguments serving sec's TLS ({} without TLS): `uvicorn.Config(app,
    **uvicorn_tls(sec))`."""
    if not sec.tls:
        return {}
    kwargs: dict[str, Any] = {"ssl_certfile": sec.tls_cert, "ssl_keyfile": sec.tls_key}
    if sec.tls_client_ca is not None:
        kwargs |= {"ssl_ca_certs": sec.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return kwargs
