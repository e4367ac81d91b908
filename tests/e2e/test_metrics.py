"""Every role's Prometheus endpoint, scraped after a few requests on a real CPU cluster (router + 1 prefill +
1 decode): the counters match what the test sent, and a restarted worker reports its restart."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import Cluster, running
from tests.e2e.test_cluster import greedy_request, stream, tokens_of, wait_blocks_returned

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [5, 6, 7, 8]]
"""The third repeats the first: a whole-prompt prefix-cache hit."""
MAX_TOKENS = 5
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running(tiny_llama_dir, tmp_path_factory.mktemp("run"), 1, 1, "--num-blocks", "128") as c:
        yield c


def scrape(cluster: Cluster, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value of every sample the role exposes."""
    url = f"http://127.0.0.1:{cluster.metrics_port(name)}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:  # noqa: S310 - loopback
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_of_every_role_match_the_requests_sent(cluster: Cluster) -> None:
    for prompt in PROMPTS:
        assert len(tokens_of(asyncio.run(stream(cluster.address, greedy_request(prompt, MAX_TOKENS))))) == MAX_TOKENS
    with pytest.raises(grpc.aio.AioRpcError):  # refused: counted as invalid, reaches no worker
        asyncio.run(stream(cluster.address, greedy_request([1, 2], max_tokens=0)))
    wait_blocks_returned(cluster)
    router = scrape(cluster, "router")
    n = len(PROMPTS)
    assert value(router, "pdserve_requests_total", outcome="ok") == n
    assert value(router, "pdserve_requests_total", outcome="invalid") == 1
    assert value(router, "pdserve_requests_total", outcome="cancelled_before_admission") == 0
    assert value(router, "pdserve_request_success_total", finish_reason="length") == n
    assert value(router, "pdserve_time_to_first_token_seconds_count") == n
    assert value(router, "pdserve_inter_token_latency_seconds_count") == n * (MAX_TOKENS - 1)
    assert value(router, "pdserve_e2e_request_latency_seconds_count") == n + 1
    assert value(router, "pdserve_prompt_tokens_total") == sum(map(len, PROMPTS))
    assert value(router, "pdserve_generation_tokens_total") == n * MAX_TOKENS
    assert value(router, "pdserve_requests_in_flight") == 0
    assert value(router, "pdserve_workers_up", role="decode") == 1
    prefill = scrape(cluster, "prefill-0")
    p = {"role": "prefill", "worker": "0"}
    assert value(prefill, "pdserve_prefix_cache_queries_total", **p) == sum(map(len, PROMPTS))
    assert value(prefill, "pdserve_prefix_cache_hits_total", **p) == len(PROMPTS[2])  # the repeat, whole
    assert value(prefill, "pdserve_prefix_cache_full_hits_total", **p) == 1
    assert value(prefill, "pdserve_handoffs_total", **p) == n
    assert value(prefill, "pdserve_kv_blocks", state="used", **p) == 0
    assert value(prefill, "pdserve_process_restarts", **p) == 0
    decode = scrape(cluster, "decode-0")
    d = {"role": "decode", "worker": "0"}
    assert value(decode, "pdserve_handoff_latency_seconds_count", **d) == n
    pulled = value(decode, "pdserve_handoff_blocks_pulled_total", **d)
    assert pulled + value(decode, "pdserve_handoff_blocks_shared_total", **d) == n  # 1 block per prompt
    assert value(decode, "pdserve_handoff_bytes_total", **d) > 0 and value(decode, "pdserve_requests_running", **d) == 0
    total = value(decode, "pdserve_kv_blocks", state="free", **d)
    assert total == 127 and value(decode, "pdserve_kv_blocks", state="used", **d) == 0


def test_every_role_froze_its_startup_heap_and_counts_collector_passes(cluster: Cluster) -> None:
    asyncio.run(stream(cluster.address, greedy_request([31, 32, 33], MAX_TOKENS)))
    roles = {"router": {}, "prefill-0": {"role": "prefill", "worker": "0"}}
    roles["decode-0"] = {"role": "decode", "worker": "0"}
    for name, labels in roles.items():
        samples = scrape(cluster, name)
        passes = [value(samples, "pdserve_gc_collections_total", generation=str(g), **labels) for g in (0, 1, 2)]
        assert all(n >= 0 for n in passes)  # NOTE: counted from the freeze on: a few requests may make no pass
        # the freeze's own full collection (~0.1 s in a worker on the CPU VM) is not counted as serving
        assert value(samples, "pdserve_gc_pause_max_seconds", **labels) < 0.05
        log = (cluster.run_dir / "logs" / f"{name}.log").read_text()
        assert "startup objects out of the garbage collector's scans" in log, f"{name} did not freeze its heap"


def test_every_role_logs_a_request_by_its_id(cluster: Cluster) -> None:
    req = greedy_request([21, 22, 23], MAX_TOKENS)
    req.request_id = "log-me-7"
    asyncio.run(stream(cluster.address, req))
    for role, needle in (("router", "ok finish=length"), ("prefill-0", "prefilled"), ("decode-0", "finished: length")):
        cluster.wait_for(
            lambda r=role, n=needle: any(  # type: ignore[misc]
                "log-me-7" in line and n in line
                for line in (cluster.run_dir / "logs" / f"{r}.log").read_text().splitlines()
            ),
            5.0,
            f"{role} to log the request",
        )


def test_a_restarted_worker_reports_its_restart(cluster: Cluster) -> None:
    os.kill(cluster.pid("decode-0"), signal.SIGKILL)
    d = {"role": "decode", "worker": "0"}

    def restarted() -> bool:
        try:
            return value(scrape(cluster, "decode-0"), "pdserve_process_restarts", **d) == 1
        except OSError:  # NOTE: dead, or not listening yet
            return False

    cluster.wait_for(restarted, 20.0, "decode-0's metrics to report 1 restart")


def test_log_level_warning_drops_the_per_request_lines(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with running(tiny_llama_dir, tmp_path / "run", 1, 1, "--num-blocks", "64", "--log-level", "warning") as quiet:
        req = greedy_request([31, 32, 33], MAX_TOKENS)
        req.request_id = "quiet-1"
        assert len(tokens_of(asyncio.run(stream(quiet.address, req)))) == MAX_TOKENS
        wait_blocks_returned(quiet)
        logs = {
            name: (quiet.run_dir / "logs" / f"{name}.log").read_text() for name in ("router", "prefill-0", "decode-0")
        }
    assert all("quiet-1" not in text for text in logs.values()), logs
