"""kill -9 each worker of a 1P+1D cluster on one GPU: seconds until its new process heartbeats, then a burst of 8
requests, and the new process's ready line (its start-up phases).

    python measure.py MODEL_DIR OUT.json [worker flags, e.g. --enforce-eager]
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, os.getcwd())  # NOTE: run from the repo root: tests.e2e.cluster starts the cluster

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb  # noqa: E402
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc  # noqa: E402
from tests.e2e.cluster import Cluster  # noqa: E402

BURST = 8


async def burst(address: str) -> list[int]:
    """BURST requests of 64 prompt tokens and 16 output tokens at once; tokens each got."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(i: int) -> int:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[100 + i] * 64))
            req.sampling.max_tokens, req.sampling.ignore_eos = 16, True
            return sum([len(r.token_ids) async for r in stub.Generate(req, timeout=120)])

        return list(await asyncio.gather(*(one(i) for i in range(BURST))))


def burst_when_routed(address: str, within_s: float = 10.0) -> list[int]:
    """A burst, retried while the router has not yet seen the new process (UNAVAILABLE)."""
    start = time.monotonic()
    while True:
        try:
            return asyncio.run(burst(address))
        except grpc.aio.AioRpcError:
            if time.monotonic() - start > within_s:
                raise
            time.sleep(0.05)


def kill_and_wait(cluster: Cluster, role: str) -> dict[str, Any]:
    old = cluster.stats(role, 0)["incarnation"]
    killed = time.monotonic()
    os.kill(cluster.pid(f"{role}-0"), signal.SIGKILL)
    cluster.wait_for(lambda: cluster.stats(role, 0)["incarnation"] != old, 120, f"{role}-0 back")
    back = time.monotonic() - killed
    start = time.monotonic()
    tokens = burst_when_routed(cluster.address)
    log = (cluster.run_dir / "logs" / f"{role}-0.log").read_text().splitlines()
    ready = [line for line in log if "ready (pid" in line][-1]
    return {
        "role": role,
        "back_s": round(back, 2),
        "burst_after_s": round(time.monotonic() - start, 2),
        "tokens": tokens,
        "ready_line": ready.split("INFO ")[-1],
    }


def main() -> None:
    model, out, extra = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    run = Path("/tmp/gpurestart-run" + ("-eager" if "--enforce-eager" in extra else ""))
    os.system(f"rm -rf {run}")
    flags = ["--load-format", "dummy", "--dtype", "bfloat16", *extra]
    start = time.monotonic()
    cluster = Cluster(model, run, 1, 1, *flags, device="cuda")
    try:
        cluster.wait_ready(400)
        result: dict[str, Any] = {"flags": flags, "cluster_ready_s": round(time.monotonic() - start, 2), "kills": []}
        print("burst", burst_when_routed(cluster.address, 300), flush=True)
        for role in ("decode", "prefill"):
            result["kills"].append(kill_and_wait(cluster, role))
            print(result["kills"][-1], flush=True)
    finally:
        cluster.stop()
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
