"""Prometheus metrics of one worker process, served over HTTP on a loopback port (prometheus_client).

Everything is read at scrape time from the worker's heartbeat (WorkerBase.heartbeat_event, already built off
the serving thread every heartbeat) plus the histograms the worker observes itself; nothing is added to the
hot loop. Names follow Prometheus conventions (`_total` counters, base units); every series carries the
labels role and worker. The port is written to {run_dir}/metrics/{role}-{worker}.port (0 picks a free one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.core.gc_pauses import GENERATIONS
from pdserve.core.messages import HeartbeatEvent

HANDOFF_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
COUNTERS: dict[str, tuple[str, str]] = {
    # heartbeat counter -> (metric name without _total, help)
    "forward_calls": ("pdserve_forward_passes", "Forward passes run."),
    "prefill_tokens_computed": ("pdserve_prefill_tokens_computed", "Prompt tokens that went through the model."),
    "prompt_tokens": ("pdserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "cached_prompt_tokens": ("pdserve_prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "full_hits": ("pdserve_prefix_cache_full_hits", "Requests whose first token came from cached logits."),
    "preemptions": ("pdserve_preemptions", "Requests sent back to waiting for lack of KV blocks."),
    "aborted": ("pdserve_requests_aborted", "Requests aborted here."),
    "blocks_pulled": ("pdserve_handoff_blocks_pulled", "KV blocks copied from prefill workers."),
    "blocks_shared": ("pdserve_handoff_blocks_shared", "Handed-off KV blocks found in the local prefix cache."),
    "handoff_bytes": ("pdserve_handoff_bytes", "KV bytes copied from prefill workers."),
    "handoffs": ("pdserve_handoffs", "Requests handed off to decode workers."),
    "jit_compiles_serving": ("pdserve_jit_compiles", "Triton kernel variants compiled after the warm-up."),
}


class WorkerCollector(Collector):
    """Gauges and counters from the latest heartbeat of a worker."""

    def __init__(self, heartbeat: Callable[[], HeartbeatEvent], restarts: int) -> None:
        self.heartbeat = heartbeat
        self.restarts = restarts

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        hb = self.heartbeat()
        labels = [hb.role, str(hb.worker_id)]
        used = hb.num_total_blocks - hb.num_free_blocks
        cached = hb.counters.get("cached_blocks", 0)
        yield _gauge("pdserve_requests_running", "Requests in the running batch (handoffs being copied in too).",
                     labels, hb.num_running)  # fmt: skip
        yield _gauge("pdserve_requests_waiting", "Requests queued (handoffs waiting for room too).", labels,
                     hb.num_waiting + hb.counters.get("handoffs_waiting", 0))  # fmt: skip
        kv = GaugeMetricFamily("pdserve_kv_blocks", "KV blocks by state.", labels=["role", "worker", "state"])
        for state, n in (("used", used), ("free", hb.num_free_blocks), ("cached", cached)):
            kv.add_metric([*labels, state], n)
        yield kv
        yield _gauge("pdserve_kv_usage_ratio", "Share of KV blocks in use.", labels, used / max(1, hb.num_total_blocks))
        yield _gauge("pdserve_process_restarts", "Times the supervisor restarted this worker.", labels, self.restarts)
        for key, (name, help_text) in COUNTERS.items():
            if key in hb.counters:
                c = CounterMetricFamily(name, help_text, labels=["role", "worker"])
                c.add_metric(labels, hb.counters[key])
                yield c
        yield from gc_metrics(hb.counters, ["role", "worker"], labels)


def gc_metrics(
    counters: dict[str, int], label_names: list[str], labels: list[str]
) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """The garbage collector's passes and pauses (core/gc_pauses.py GcPauses.counters), if counted."""
    if "gc_pause_us_gen2" not in counters:
        return
    passes = CounterMetricFamily(
        "pdserve_gc_collections", "Garbage-collector passes, by generation.", labels=[*label_names, "generation"]
    )
    for gen in GENERATIONS:
        passes.add_metric([*labels, str(gen)], counters[f"gc_collections_gen{gen}"])
    yield passes
    full = CounterMetricFamily("pdserve_gc_full_pause_seconds", "Time stopped in full collections.", labels=label_names)
    full.add_metric(labels, counters["gc_pause_us_gen2"] / 1e6)
    yield full
    longest = GaugeMetricFamily("pdserve_gc_pause_max_seconds", "Longest collector pass so far.", labels=label_names)
    longest.add_metric(labels, counters["gc_pause_us_max"] / 1e6)
    yield longest


def _gauge(name: str, help_text: str, labels: list[str], value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, help_text, labels=["role", "worker"])
    g.add_metric(labels, value)
    return g


class WorkerMetrics:
    """The registry of one worker process and the histograms it observes."""

    def __init__(self, role: str, worker_id: int, heartbeat: Callable[[], HeartbeatEvent], restarts: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(WorkerCollector(heartbeat, restarts))
        handoff = Histogram(
            "pdserve_handoff_latency_seconds",
            "From the first token at the prefill worker to the request decoding here (its KV copied).",
            ["role", "worker"],
            buckets=HANDOFF_BUCKETS_S,
            registry=self.registry,
        )
        self.handoff_latency = handoff.labels(role, str(worker_id))

    def serve(self, port: int, path: Path) -> int:
        return serve_registry(self.registry, port, path)


def serve_registry(registry: CollectorRegistry, port: int, path: Path) -> int:
    """Serve registry on 127.0.0.1:port (0: any free one) from a daemon thread; write the port to path; the
    port. NOTE: the router uses it too (this module imports no torch)."""
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(server.server_port))
    return int(server.server_port)
