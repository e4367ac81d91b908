"""`pip install .` (a wheel, not editable) into a fresh venv: only `pdserve` lands in site-packages, and its
entry points run a cluster, a client and the serving benchmark from there, away from the checkout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_newcomer import READY, fresh_env

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 900.0
READY_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the CPU torch wheel and pdserve installed from a clone of HEAD (no extras)."""
    base = tmp_path_factory.mktemp("wheel")
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(base / "src")], check=True)
    venv = base / "venv"
    env = fresh_env(base)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    for args in (["torch==2.13.0"], [str(base / "src")]):
        subprocess.run([*pip, *args], check=True, env=env, cwd=base, timeout=INSTALL_TIMEOUT_S)
    return venv


def run_in(venv: Path, argv: list[str], cwd: Path, **kw: object) -> subprocess.CompletedProcess[str]:
    env = fresh_env(cwd)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, **kw)  # type: ignore[call-overload]


def test_only_pdserve_is_importable_from_the_wheel(venv: Path, tmp_path: Path) -> None:
    site = next((venv / "lib").glob("python3*/site-packages"))
    folders = ("core", "kernels", "kvtransfer", "router", "prefill_worker", "decode_worker", "proto")
    assert [name for name in folders if (site / name).exists()] == []
    assert (site / "pdserve").is_dir() and (site / f"pdserve-{_version()}.dist-info").is_dir()
    code = (
        "import importlib.util as u, pdserve.router as r\n"
        "print(u.find_spec('proto'), u.find_spec('kernels'), u.find_spec('core'), r.__file__)\n"
    )
    out = run_in(venv, [str(venv / "bin" / "python"), "-c", code], tmp_path, check=True).stdout.split()
    assert out[:3] == ["None", "None", "None"]
    assert out[3] == str(site / "pdserve" / "router" / "__init__.py")


def _version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture
def cluster(venv: Path, tiny_llama_dir: Path, tmp_path: Path) -> Iterator[str]:
    argv = [str(venv / "bin" / "pdserve-cluster"), "--model", str(tiny_llama_dir), "--device", "cpu", "--port", "0"]
    argv += ["--metrics-port", "-1", "--num-blocks", "64", "--run-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=fresh_env(tmp_path), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    start, lines = time.monotonic(), []
    try:
        for line in proc.stdout:
            lines.append(line)
            if ready := READY.search(line):
                break
            assert time.monotonic() - start < READY_TIMEOUT_S, "".join(lines[-30:])
        else:
            pytest.fail(f"pdserve-cluster exited ({proc.wait()}):\n" + "".join(lines[-30:]))
        yield ready.group(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_entry_points_serve_answer_and_benchmark(venv: Path, cluster: str, tmp_path: Path) -> None:
    client = [str(venv / "bin" / "pdserve-client"), "--address", cluster, "--max-tokens", "8", "--temperature", "0"]
    answer = run_in(venv, [*client, "--ignore-eos", "hello there"], tmp_path)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip(), "the client printed no text"
    bench = [str(venv / "bin" / "pdserve-bench-serving"), "--address", cluster, "--num-prompts", "4"]
    bench += ["--input-len", "16", "--output-len", "4", "--no-progress", "--result-json", str(tmp_path / "r.json")]
    done = run_in(venv, bench, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["metrics"]["completed"] == 4
