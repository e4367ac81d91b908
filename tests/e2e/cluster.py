"""Start a real cluster (pdserve-cluster, router/cluster_cli.py) for end-to-end tests and look inside it."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """router + N prefill + M decode processes under the supervisor, in a private run dir."""

    def __init__(
        self, model: Path, run_dir: Path, prefill: int = 1, decode: int = 1, *extra: str, device: str = "cpu",
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.run_dir = run_dir
        argv = [sys.executable, "-m", "pdserve.router.cluster_cli", "--model", str(model)]
        argv += ["--prefill", str(prefill), "--decode", str(decode), "--port", str(self.port)]
        # NOTE: metrics and HTTP on free ports (RUN_DIR/metrics/*.port, the ready line): clusters of parallel runs
        # must not collide
        argv += ["--run-dir", str(run_dir), "--device", device, "--metrics-port", "0", "--http-port", "0", *extra]
        self.output: list[str] = []
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any("pdserve cluster ready on" in line for line in self.output):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"cluster not ready: {''.join(self.output)}\n{self.logs()}")

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible HTTP API's base URL, from the ready line."""
        mark = "OpenAI-compatible HTTP on "
        line = next(line for line in self.output if "pdserve cluster ready on" in line and mark in line)
        return line.split(mark, 1)[1].split()[0]

    def logs(self) -> str:
        out = []
        for log in sorted((self.run_dir / "logs").glob("*.log")):
            out.append(f"==== {log.name}\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def stats(self, role: str, worker: int) -> dict[str, Any]:
        return json.loads((self.run_dir / "stats" / f"{role}-{worker}.json").read_text())  # type: ignore[no-any-return]

    def status(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "status.json").read_text())  # type: ignore[no-any-return]

    def metrics_port(self, name: str) -> int:
        """The Prometheus port of router / prefill-i / decode-j."""
        return int((self.run_dir / "metrics" / f"{name}.port").read_text())

    def pid(self, name: str) -> int:
        role = next(r for r in self.status()["roles"] if r["name"] == name)
        return int(role["pid"])

    def wait_for(self, predicate: Any, timeout: float, what: str) -> float:
        """Poll predicate until true; seconds it took. Raises with the logs on timeout."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            try:
                if predicate():
                    return time.monotonic() - start
            except (FileNotFoundError, json.JSONDecodeError, KeyError, StopIteration):
                pass
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def running(
    model: Path, run_dir: Path, prefill: int, decode: int, *extra: str, device: str = "cpu"
) -> Iterator[Cluster]:
    """A cluster that is ready inside the block and stopped after it (module fixtures yield from this)."""
    cluster = Cluster(model, run_dir, prefill, decode, *extra, device=device)
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()
