"""pdserve-bench-serving against a real tiny CPU cluster: every request completes, exact token counts, plots."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.router.benchmark import datasets as ds
from pdserve.router.benchmark.cli import main
from pdserve.router.benchmark.plots import PLOT_FILES
from tests.e2e.cluster import ROOT, Cluster
from tests.models import TINY_LLAMA_EOS_ID, TINY_LLAMA_VOCAB_SIZE

NUM_PROMPTS = 6
VOCAB = ds.VocabInfo(TINY_LLAMA_VOCAB_SIZE, (TINY_LLAMA_EOS_ID,))


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tiny_llama_dir, tmp_path_factory.mktemp("run"), 1, 1, "--num-blocks", "256")
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def check_report(result: dict[str, Any], plot_dir: Path, expected_output_tokens: int) -> None:
    metrics = result["metrics"]
    assert (metrics["completed"], metrics["failed"]) == (NUM_PROMPTS, 0)
    assert metrics["total_output_tokens"] == expected_output_tokens
    assert sum(r["expected_output_len"] for r in result["requests"]) == expected_output_tokens
    assert all(r["finish_reason"] == "length" and r["ok"] for r in result["requests"])
    assert metrics["mean_ttft_ms"] > 0 and metrics["p99_itl_ms"] > 0 and metrics["duration"] > 0
    assert result["config"]["model"]["vocab_size"] == TINY_LLAMA_VOCAB_SIZE
    for name in PLOT_FILES:
        assert (plot_dir / name).stat().st_size > 1000, name


def test_random_dataset_completes_with_exact_output_tokens(cluster: Cluster, tmp_path: Path) -> None:
    argv = ["--address", cluster.address, "--dataset", "random", "--num-prompts", str(NUM_PROMPTS)]
    argv += ["--input-len", "8:40", "--output-len", "4:12", "--seed", "11", "--goodput", "e2el:60000"]
    argv += ["--result-json", str(tmp_path / "r.json"), "--save-detailed", "--plot", str(tmp_path / "plots")]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), *argv], capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"Serving Benchmark Result" in proc.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    specs = ds.random_dataset(VOCAB, NUM_PROMPTS, (8, 40), (4, 12), seed=11)
    check_report(result, tmp_path / "plots", sum(s.output_len for s in specs))
    assert result["metrics"]["total_input_tokens"] == sum(s.prompt_len for s in specs)
    assert result["metrics"]["request_goodput"] == pytest.approx(result["metrics"]["request_throughput"])
    assert result["config"]["dataset"] == {
        "name": "random",
        "num_prompts": 6,
        "input_len": "8:40",
        "output_len": "4:12",
    }


def test_shared_prefix_dataset_hits_the_prefix_cache(cluster: Cluster, tmp_path: Path) -> None:
    argv = ["--address", cluster.address, "--dataset", "shared-prefix", "--num-prompts", str(NUM_PROMPTS)]
    argv += ["--num-groups", "2", "--prefix-len", "48", "--suffix-len", "8", "--output-len", "6"]
    # NOTE: one request at a time, so each group's later requests find the first one's prefix blocks cached.
    argv += ["--max-concurrency", "1", "--no-progress", "--result-json", str(tmp_path / "r.json")]
    argv += ["--save-detailed", "--plot", str(tmp_path / "plots")]
    assert main(argv) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    check_report(result, tmp_path / "plots", NUM_PROMPTS * 6)
    assert result["metrics"]["total_input_tokens"] == NUM_PROMPTS * 56
    cached = [r["cached_tokens"] for r in result["requests"]]
    assert sum(cached) >= (NUM_PROMPTS - 2) * 48 > 0  # all but each group's first request reuse the prefix
    assert result["metrics"]["total_cached_tokens"] == sum(cached)
