"""CURVE on the TCP sockets of a cluster over hosts (core/curve.py, core/ipc.py): processes with the cluster's
keys talk; a peer without them, or with another client key, never reaches a socket's reader and is logged once."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import zmq

from pdserve.core import ipc
from pdserve.core.curve import KEYS_FILE, ClusterKeys
from pdserve.core.messages import AbortCmd, encode
from pdserve.router import cluster_cli
from tests.e2e.test_multi_host import free_base_port


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    topo = {"router": "127.0.0.1", "prefill": ["127.0.0.1"], "decode": ["127.0.0.1"], "base_port": free_base_port()}
    (tmp_path / ipc.TOPOLOGY_FILE).write_text(json.dumps(topo))
    ClusterKeys.make().write(tmp_path / KEYS_FILE)
    return tmp_path


def _receive(sock: zmq.Socket, timeout_s: float) -> list[object]:
    deadline = time.monotonic() + timeout_s
    got: list[object] = []
    while time.monotonic() < deadline and not got:
        sock.poll(50)
        got += ipc.recv_all(sock)
    return got


def test_processes_with_the_cluster_keys_talk(run_dir: Path) -> None:
    server_ctx, client_ctx = zmq.Context(), zmq.Context()  # NOTE: two contexts, as two processes
    try:
        inbox = ipc.bind_pull(server_ctx, ipc.decode_addr(run_dir, 0))
        assert inbox.getsockopt(zmq.CURVE_SERVER) == 1
        push = ipc.connect_push(client_ctx, ipc.decode_addr(run_dir, 0))
        assert ipc.send(push, AbortCmd("r1"), wait_ms=2000)
        assert _receive(inbox, 5.0) == [AbortCmd("r1")]
    finally:
        server_ctx.destroy(linger=0)
        client_ctx.destroy(linger=0)


@pytest.mark.parametrize("peer", ["no CURVE", "another client key", "another cluster"])
def test_a_peer_without_the_keys_is_dropped_and_logged_once(
    run_dir: Path, peer: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys, other = ipc.cluster_keys(str(run_dir)), ClusterKeys.make()
    addr = ipc.decode_addr(run_dir, 0)
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.core.curve"):
            inbox = ipc.bind_pull(server_ctx, addr)
            intruders = []
            for _ in range(3):
                sock = client_ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                if peer == "another client key":
                    ClusterKeys(keys.server_public, keys.server_secret, other.client_public, other.client_secret
                                ).connect_as_client(sock)  # fmt: skip
                elif peer == "another cluster":
                    other.connect_as_client(sock)
                sock.connect(addr)
                sock.send(encode(AbortCmd("intruder")), flags=zmq.NOBLOCK)  # NOTE: queued until a handshake
                intruders.append(sock)
            assert _receive(inbox, 1.5) == []
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "frames are dropped" in warnings[0].getMessage()
        where = "127.0.0.1" if peer == "another client key" else addr
        assert where in warnings[0].getMessage()
        push = ipc.connect_push(client_ctx, addr)
        assert ipc.send(push, AbortCmd("r2"), wait_ms=2000)
        assert _receive(inbox, 5.0) == [AbortCmd("r2")]  # NOTE: the cluster's own peers still get through
    finally:
        server_ctx.destroy(linger=0)
        client_ctx.destroy(linger=0)


def test_keys_files_are_private_and_required(tmp_path: Path, run_dir: Path) -> None:
    keys = ClusterKeys.make()
    keys.write(tmp_path / "k.json")
    assert os.stat(tmp_path / "k.json").st_mode & 0o777 == 0o600
    assert ClusterKeys.read(tmp_path / "k.json") == keys
    assert "server_secret" not in repr(keys) and keys.server_secret.decode() not in repr(keys)
    with pytest.raises(FileExistsError):
        keys.write(tmp_path / "k.json")
    os.chmod(tmp_path / "k.json", 0o644)
    with pytest.raises(ValueError, match="readable by other users"):
        ClusterKeys.read(tmp_path / "k.json")
    (run_dir / KEYS_FILE).unlink()
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="cluster_keys.json is missing"):
            ipc.bind_pull(ctx, ipc.prefill_addr(run_dir, 0))
    finally:
        ctx.destroy(linger=0)


def test_ipc_sockets_stay_plain(tmp_path: Path) -> None:
    ctx = zmq.Context()
    try:
        sock = ipc.bind_pull(ctx, ipc.decode_addr(tmp_path, 0))
        assert ipc.decode_addr(tmp_path, 0).startswith("ipc://") and sock.getsockopt(zmq.CURVE_SERVER) == 0
    finally:
        ctx.destroy(linger=0)


def test_the_router_hosts_launcher_makes_the_keys_the_others_need_them(tmp_path: Path) -> None:
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps({"router": "10.0.0.1", "prefill": ["10.0.0.2"], "decode": ["10.0.0.3"]}))
    parser = cluster_cli.build_parser()
    argv = ["--model", "m", "--topology", str(topo), "--roles"]
    workers, _ = cluster_cli.parse_args(parser, [*argv, "prefill-0,decode-0"])
    with pytest.raises(ValueError, match="topo.keys: no such file; copy it from the router's host"):
        cluster_cli.cluster_keys(workers)
    router, _ = cluster_cli.parse_args(parser, [*argv, "router"])
    made = cluster_cli.cluster_keys(router)
    assert os.stat(tmp_path / "topo.keys").st_mode & 0o777 == 0o600
    assert cluster_cli.cluster_keys(workers) == made == cluster_cli.cluster_keys(router)
    assert cluster_cli.cluster_keys(cluster_cli.parse_args(parser, ["--model", "m"])[0]) is None
    run_dir = tmp_path / "run"
    cluster_cli.make_run_dir(run_dir)
    assert run_dir.stat().st_mode & 0o777 == 0o700 and (run_dir / "logs").is_dir()
