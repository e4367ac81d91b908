"""core/ipc.py Topology: a run dir with topology.json turns every socket into tcp://HOST:PORT on the host the
topology names; without one, ipc:// paths in the run dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.core import ipc


def write(run_dir: Path, **topo: object) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ipc.TOPOLOGY_FILE).write_text(json.dumps(topo))
    return run_dir


def test_addresses_follow_the_topology(tmp_path: Path) -> None:
    run = write(tmp_path / "a", router="10.0.0.1", prefill=["10.0.0.2", "10.0.0.2"], decode=["10.0.0.3"],
                base_port=9000)  # fmt: skip
    assert ipc.router_addr(run) == "tcp://10.0.0.1:9000"
    assert ipc.prefill_addr(run, 1) == "tcp://10.0.0.2:9110"
    assert ipc.handshake_addr(run, 1) == "tcp://10.0.0.2:9111"
    assert ipc.kv_events_addr(run, "prefill", 0) == "tcp://10.0.0.2:9102"
    assert ipc.decode_addr(run, 0) == "tcp://10.0.0.3:14000"
    assert ipc.kv_events_addr(run, "decode", 0) == "tcp://10.0.0.3:14002"
    assert ipc.host_of(run, "prefill", 1) == "10.0.0.2" and ipc.topology(str(run)).num_hosts == 3  # type: ignore[union-attr]


def test_without_a_topology_sockets_are_ipc_paths_in_the_run_dir(tmp_path: Path) -> None:
    assert ipc.router_addr(tmp_path) == f"ipc://{tmp_path / 'router.sock'}"
    assert ipc.decode_addr(tmp_path, 2) == f"ipc://{tmp_path / 'decode-2.sock'}"
    assert ipc.host_of(tmp_path, "decode", 0) == "127.0.0.1"


@pytest.mark.parametrize(
    "topo",
    [{"router": "h", "prefill": ["h"]}, {"router": "h", "prefill": [], "decode": []}, {"router": "h", "prefill": [],
     "decode": ["h"], "base_port": 80}],
)  # fmt: skip
def test_a_bad_topology_is_a_value_error(tmp_path: Path, topo: dict) -> None:
    with pytest.raises(ValueError, match="bad topology"):
        ipc.Topology.read(write(tmp_path / "b", **topo) / ipc.TOPOLOGY_FILE)
