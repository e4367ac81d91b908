"""A worker whose KV layout differs from the cluster's, through the real processes: router + prefill-0 +
decode-0 with 16-token blocks and a decode-1 with 32-token blocks (started by hand: the supervisor gives every
worker the same flags).

The router refuses decode-1 (one error line naming the field; it never counts as up, so health and routing
ignore it) and serves every request on decode-0; a handoff sent to decode-1 anyway makes it handshake with
prefill-0, which refuses it (one line naming the field); decode-1 reports the request UNAVAILABLE and keeps
running; nothing leaks.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.core.messages import HandoffCmd, Sampling, Timings, encode, pack_token_ids
from tests.child_env import child_env
from tests.e2e.cluster import free_port
from tests.e2e.test_cluster import greedy_request, stream, tokens_of
from tests.reliability.report import record

READY_TIMEOUT_S = 60.0
ROUTER_FLAGS = ("--prefill", "1", "--decode", "2", "--block-size", "16")
"""As the supervisor starts it: the cluster's block size is configured."""


class HandCluster:
    """router (1 prefill, 2 decode) + workers started directly, each with its own flags."""

    def __init__(self, model: Path, run_dir: Path) -> None:
        self.run_dir, self.port = run_dir, free_port()
        (run_dir / "logs").mkdir(parents=True)
        common = ["--model", str(model), "--run-dir", str(run_dir)]
        worker = [*common, "--device", "cpu", "--transport", "shm", "--num-blocks", "64", "--num-prefill", "1"]
        worker += ["--num-decode", "2"]
        self.procs = {
            "router": self._start("router", [*common, "--port", str(self.port), *ROUTER_FLAGS]),
            "prefill-0": self._start("prefill_worker", [*worker, "--block-size", "16", "--worker-id", "0"]),
            "decode-0": self._start("decode_worker", [*worker, "--block-size", "16", "--worker-id", "0"]),
            "decode-1": self._start("decode_worker", [*worker, "--block-size", "32", "--worker-id", "1"]),
        }

    def _start(self, module: str, args: list[str]) -> subprocess.Popen[bytes]:
        name = module if module == "router" else f"{module.split('_')[0]}-{args[-1]}"
        log = open(self.run_dir / "logs" / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
        env = child_env()
        return subprocess.Popen(
            [sys.executable, "-m", f"pdserve.{module}", *args], stdout=log, stderr=subprocess.STDOUT, env=env
        )

    def log(self, name: str) -> str:
        return (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HandCluster]:
    c = HandCluster(tiny_llama_dir, tmp_path_factory.mktemp("run"))
    try:
        yield c
    finally:
        c.stop()


def wait_until(predicate: object, what: str, cluster: HandCluster) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: " + "\n".join(cluster.log(n)[-1500:] for n in cluster.procs))


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        return int(reply.status)


def test_a_worker_with_another_kv_layout_is_refused_and_the_rest_serve(cluster: HandCluster) -> None:
    address = f"127.0.0.1:{cluster.port}"
    wait_until(lambda: "refused decode worker 1" in cluster.log("router"), "the router's refusal", cluster)
    wait_until(lambda: "decode worker 0 is up" in cluster.log("router"), "decode-0 up", cluster)
    wait_until(lambda: "prefill worker 0 is up" in cluster.log("router"), "prefill-0 up", cluster)
    refusal = [line for line in cluster.log("router").splitlines() if "refused decode worker 1" in line]
    assert len(refusal) == 1 and "block_size 16 != 32" in refusal[0], refusal
    assert "decode worker 1 is up" not in cluster.log("router")
    assert asyncio.run(health(address)) == health_pb2.HealthCheckResponse.SERVING
    failures = 0
    for i in range(4):  # every request lands on decode-0
        got = asyncio.run(stream(address, greedy_request([3 + i, 5, 7], max_tokens=6)))
        failures += len(tokens_of(got)) != 6
    # a handoff reaching decode-1 anyway: it handshakes with prefill-0, which refuses the layout
    push: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(f"ipc://{cluster.run_dir / 'decode-1.sock'}")
    sampling = Sampling(temperature=0.0, max_tokens=4, num_generated=1)
    handoff = HandoffCmd("stray", 0, "some-pool", 1, [1], pack_token_ids([1, 2, 3, 4]), 3, 0, sampling, Timings())
    push.send(encode(handoff))
    push.close(linger=2000)
    wait_until(lambda: "refused a handshake" in cluster.log("prefill-0"), "prefill-0's refusal", cluster)
    wait_until(lambda: "refused the handshake" in cluster.log("decode-1"), "decode-1 to see the refusal", cluster)
    assert "KV layout mismatch: block_size 16 != 32" in cluster.log("prefill-0")
    assert all(p.poll() is None for p in cluster.procs.values()), "a process died"
    record("worker with another KV layout", 5, failures, 0, None)
    assert failures == 0
