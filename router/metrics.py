"""Prometheus metrics of the router (prometheus_client), served over HTTP on a loopback port.

Per request, as the client sees it: time to first token (arrival at the router to the first token leaving
it: queue + prefill + handoff + the first decode step), inter-token latency, end-to-end latency, one count
per call by its outcome (router/outcome.py) and one per successful stream by finish reason. Plus the
admission queue, requests in flight, workers up per role, each up worker's TP size and request migrations, read
at scrape time.
vLLM's metric names, Prometheus style.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.core.gc_pauses import GcPauses
from pdserve.core.metrics import gc_metrics, serve_registry
from pdserve.router.outcome import OK, OUTCOMES
from pdserve.router.workers import WorkerHub

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5)  # fmt: skip


class HubCollector(Collector):
    """What the WorkerHub knows at scrape time, and the router's garbage-collector passes."""

    def __init__(self, hub: WorkerHub, gc_pauses: GcPauses) -> None:
        self.hub = hub
        self.gc_pauses = gc_pauses

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        hub = self.hub
        yield GaugeMetricFamily("pdserve_requests_in_flight", "Requests admitted to workers.", value=len(hub.table))
        yield GaugeMetricFamily(
            "pdserve_admission_queue_requests", "Requests waiting for KV room.", value=len(hub.admission)
        )
        up = GaugeMetricFamily("pdserve_workers_up", "Workers of a role that heartbeat.", labels=["role"])
        for role in ("prefill", "decode"):
            up.add_metric([role], len(hub.liveness.up(role)))
        yield up
        tp = GaugeMetricFamily(
            "pdserve_worker_tp_size", "TP ranks (processes) of an up worker.", labels=["role", "worker"]
        )
        for st in hub.liveness.all_workers():
            if st.up:
                tp.add_metric([st.role, str(st.worker_id)], st.tp_size)
        yield tp
        yield CounterMetricFamily(
            "pdserve_request_migrations", "Requests resumed on other workers after a worker loss.",
            value=hub.num_migrations,
        )  # fmt: skip
        yield from gc_metrics(self.gc_pauses.counters(), [], [])


class RouterMetrics:
    """The router's registry: histograms and counters the servicer observes, the hub's gauges."""

    def __init__(self, hub: WorkerHub, gc_pauses: GcPauses) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(HubCollector(hub, gc_pauses))
        r = self.registry
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "Arrival to the first token leaving the router.",
            buckets=LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds", "Time between tokens of a stream, per token.",
            buckets=ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds", "Arrival to the end of the stream.",
            buckets=LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "pdserve_requests", "Calls ended, one outcome each (router/outcome.py).", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # NOTE: every outcome is scraped from the start, 0 until it happens
        self.finished = Counter(
            "pdserve_request_success", "Streams that ended OK, by finish reason.", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens streamed to clients.", registry=r)

    def serve(self, port: int, path: Path) -> int:
        return serve_registry(self.registry, port, path)


class StreamClock:
    """One stream's timestamps, observed into RouterMetrics as its responses leave."""

    def __init__(self, metrics: RouterMetrics, arrival: float) -> None:
        self.metrics, self.arrival, self.last, self.first = metrics, arrival, 0.0, 0.0

    def ttft_ms(self) -> float:
        """Milliseconds to the first token; 0 when none left."""
        return (self.first - self.arrival) * 1e3 if self.first else 0.0

    def sent(self, num_tokens: int, now: float) -> None:
        """A response with num_tokens tokens left at `now` (time.time())."""
        if not num_tokens:
            return
        m = self.metrics
        m.generation_tokens.inc(num_tokens)
        if not self.last:
            self.first = now
            m.ttft.observe(now - self.arrival)
            num_tokens -= 1
        if num_tokens:
            # NOTE: tokens that leave together share the gap since the previous response (vLLM's ITL per token)
            gap = (now - self.last) / num_tokens if self.last else 0.0
            for _ in range(num_tokens):
                m.itl.observe(gap)
        self.last = now

    def ended(self, outcome: str, finish_reason: str, now: float) -> None:
        """The call ended at `now`; finish_reason counts only for an "ok" outcome."""
        self.metrics.e2e.observe(now - self.arrival)
        self.metrics.requests.labels(outcome).inc()
        if outcome == OK:
            self.metrics.finished.labels(finish_reason).inc()
