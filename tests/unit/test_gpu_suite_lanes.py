"""scripts/gpu_suite.sh lanes, with stub nvidia-smi and python3: six pytest lanes at once, each pinned to its GPUs,
the last running every test file the others do not name, logs packed into one file."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

from tests.child_env import ROOT

STUB_PYTHON = """#!/bin/bash
[ "$1" = "-c" ] && exit 0
echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES $*"
echo "1 passed in 0.01s"
"""


def test_lanes_pin_gpus_and_the_last_runs_every_file_the_others_do_not_name(tmp_path: Path) -> None:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "nvidia-smi").write_text("#!/bin/bash\necho 'NVIDIA H200, 580, 143771 MiB'\n")
    (stubs / "python3").write_text(STUB_PYTHON)
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", "scripts/gpu_suite.sh", "lanes"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("1 passed") == 6
    with tarfile.open(tmp_path / "out" / "lanes.tgz") as tar:
        tar.extractall(tmp_path / "logs", filter="data")
    logs = {p.name: p.read_text() for p in (tmp_path / "logs" / "lanes").glob("*.log")}
    assert sorted(logs) == [f"lane{i}.log" for i in range(6)]
    calls = [log.splitlines()[1].split() for _, log in sorted(logs.items())]
    gpus = [call[0].removeprefix("CUDA_VISIBLE_DEVICES=") for call in calls]
    assert gpus == ["2,3", "0,1", "0", "1", "3", "2"]
    named = [arg for call in calls[:5] for arg in call if arg.startswith("tests/")]
    ignored = [arg.removeprefix("--ignore=") for arg in calls[5] if arg.startswith("--ignore=")]
    assert sorted(named) == sorted(ignored) and len(set(named)) == len(named)  # every file in one lane only
    assert all((ROOT / f).is_file() for f in named) and "tests" in calls[5]
    two_gpu = {"tests/gpu/test_two_gpus.py", "tests/gpu/test_kvtransfer_cuda.py", "tests/kernels/test_block_copy.py"}
    assert two_gpu <= set(calls[1]) and "tests/gpu/test_cluster_cuda.py" in calls[2]  # pairs; clusters on GPU 0
