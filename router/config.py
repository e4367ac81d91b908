"""The router process's settings (one frozen dataclass, filled from the command line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdserve.router.auth import EdgeSecurity

Routing = Literal["prefix", "round_robin"]
HTTP_READY = " (HTTP {url})"
"""Follows the router's ready line (core/lifecycle.py READY_LINE) when it serves HTTP: the launcher reads the URL."""


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens, which workers it expects and how it judges them alive."""

    model_dir: str
    """Model folder: config.json, tokenizer.json and the chat template."""
    run_dir: str
    """The cluster's run directory, home of every ipc socket (core/ipc.py)."""
    num_prefill: int = 1
    """Prefill workers 0..num_prefill-1; 0: colocated mode (decode workers prefill their own requests)."""
    num_decode: int = 1
    """Decode workers 0..num_decode-1."""
    port: int = 50051
    """gRPC port; 0 picks a free one (the ready line names it)."""
    bind: str = "127.0.0.1"
    """gRPC host to listen on; beyond loopback, clients must authenticate (router/auth.py check_exposure)."""
    heartbeat_timeout: float = 2.0
    """A worker with no heartbeat for this many seconds is down."""
    block_size: int | None = None
    """KV block size of the workers, reported by GetModelInfo when known."""
    grace_s: float = 5.0
    """On SIGTERM, streams in flight get this long to finish."""
    routing: Routing = "prefix"
    """prefix: the prefill worker with the least uncached + queued tokens (router/routing.py); round_robin: the
    cache-blind baseline of the routing benchmark."""
    max_queue_skew: int = 8
    """A prefill worker with this many more queued requests than the least-loaded one gets no more (prefix)."""
    conditional_disagg: bool = False
    """Send a request straight to its decode worker when that worker holds all but a short tail of the prompt."""
    local_prefill_threshold: int = 64
    """conditional_disagg: the longest uncached tail (tokens) a decode worker computes itself."""
    metrics_port: int | None = None
    """Prometheus metrics on 127.0.0.1:metrics_port (0: any free port; the port goes to run_dir/metrics/)."""
    max_queued: int = 1024
    """Requests that may wait for KV room (router/admission.py); one more is refused RESOURCE_EXHAUSTED."""
    busy_poll_s: float = 0.0
    """After a request's arrival or a token, the event loop polls without blocking this long (router/busy_poll.py);
    0: never (the default of CPU clusters)."""
    max_migrations: int = 2
    """Times a request whose worker was lost is sent again (prompt + tokens so far) to other workers; 0: it
    fails UNAVAILABLE instead."""
    security: EdgeSecurity = field(default_factory=EdgeSecurity)
    """TLS and API keys of the gRPC port (router/auth.py); default: plaintext, no keys."""
    http_port: int | None = None
    """OpenAI-compatible HTTP API (router/http_api.py) on bind:http_port, with the gRPC port's TLS and API keys;
    0 picks a free one (the ready line names it); None: no HTTP."""

    frontend: int = 0
    """This router process's index among the cluster's front ends (its inbox: core/ipc.py router_addr)."""
    num_frontends: int = 1
    """Router processes sharing the gRPC and HTTP ports (SO_REUSEPORT) and the load counts (router/load_table.py)."""

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0

    @property
    def address(self) -> str:
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"{host}:{self.port}"
