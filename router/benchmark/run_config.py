"""How the benchmark client talks to the router (RunConfig), its clock, and the one-request sender both
backends implement (runner.py: gRPC; openai_client.py: HTTP)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from pdserve.router.benchmark.datasets import RequestSpec
from pdserve.router.benchmark.metrics import RequestRecord
from pdserve.router.client_auth import ClientAuth

Backend = Literal["grpc", "openai"]


@dataclass(frozen=True)
class RunConfig:
    """How the runner talks to the router."""

    address: str
    """host:port of the router's gRPC server."""
    max_concurrency: int | None = None
    """Open-loop requests in flight at most; None = unlimited."""
    ignore_eos: bool = True
    """Generate exactly max_tokens tokens."""
    temperature: float = 0.0
    """0 = greedy."""
    ready_timeout_s: float = 30.0
    """How long to wait for the channel to connect."""
    show_progress: bool = True
    """Draw a tqdm progress bar on stderr."""
    backend: Backend = "grpc"
    """grpc: pdserve.v1.Generation at address; openai: POST http://address/v1/completions (openai_client.py)."""
    model_name: str = ""
    """The "model" field of OpenAI requests."""
    auth: ClientAuth = field(default_factory=ClientAuth)
    """TLS and API key of a secured router (grpc)."""
    grpc_channels: int = 1
    """gRPC channels per client process, each its own TCP connection, streams dealt over them in turn: a port
    shared by several front ends (SO_REUSEPORT) spreads connections, not calls."""
    deadline_s: float | None = None
    """Open-loop requests still streaming this many seconds after the start are cut off and recorded as failed
    (a goodput sweep's drain limit); None = wait for every one."""


class Clock:
    """Seconds since the benchmark started (perf_counter: CLOCK_MONOTONIC, one clock for every process)."""

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = time.perf_counter() if t0 is None else t0

    def now(self) -> float:
        return time.perf_counter() - self.t0


Sender = Callable[[RequestSpec, int, Clock], Awaitable[RequestRecord]]
"""Sends one request (spec, its index) and records it; one per backend connection."""
