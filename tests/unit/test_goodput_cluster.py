"""A goodput sweep of two rates against a real tiny CPU cluster (1 prefill + 1 decode worker): one invocation,
each rate's JSON beside the summary, only the window's requests counted, every one good under loose SLOs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.router.benchmark import datasets as ds
from pdserve.router.benchmark.cli import main
from pdserve.router.benchmark.lengths import UniformWorkload
from tests.e2e.cluster import Cluster, running
from tests.models import TINY_LLAMA_EOS_ID, TINY_LLAMA_VOCAB_SIZE

pytestmark = pytest.mark.slow

RATES, WARMUP_S, DURATION_S, SEED = (2.0, 4.0), 1.0, 3.0, 5


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running(tiny_llama_dir, tmp_path_factory.mktemp("run"), 1, 1, "--num-blocks", "256") as c:
        yield c


def sent_in_window(rate: float) -> int:
    """Requests the sweep schedules inside the window at this rate (the workload is a function of the seed)."""
    vocab = ds.VocabInfo(TINY_LLAMA_VOCAB_SIZE, (TINY_LLAMA_EOS_ID,))
    lengths = UniformWorkload((8, 24), (2, 6))
    workload = ds.sampled_workload(vocab, lengths, rate, WARMUP_S + DURATION_S, 512, SEED)
    return sum(WARMUP_S <= (s.start_time or 0.0) < WARMUP_S + DURATION_S for s in workload.requests)


def test_sweep_of_two_rates_against_a_tiny_cluster(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    argv = ["--address", cluster.address, "--dataset", "random", "--input-len", "8:24", "--output-len", "2:6"]
    argv += ["--request-rate", ",".join(f"{r:g}" for r in RATES), "--duration", str(DURATION_S)]
    argv += ["--warmup", str(WARMUP_S), "--drain-timeout", "20", "--seed", str(SEED), "--no-progress"]
    argv += ["--goodput", "ttft:30000", "tpot:30000", "--num-gpus", "2", "--layout", "1P:1D"]
    argv += ["--result-json", str(out), "--plot", str(tmp_path / "plots")]
    assert main(argv) == 0, cluster.logs()
    report = json.loads(out.read_text())
    sweep = report["sweep"]
    assert [r["request_rate"] for r in sweep["rates"]] == list(RATES)
    assert sweep["layout"] == "1P:1D" and sweep["num_gpus"] == 2 and sweep["slos_ms"] == {"ttft": 30000, "tpot": 30000}
    for rate, row in zip(RATES, sweep["rates"], strict=True):
        assert abs(row["num_requests"] - sent_in_window(rate)) <= 1  # NOTE: a send may slip past the window's end
        assert row["slo_attainment"] == 1.0 and row["goodput"] == pytest.approx(row["num_requests"] / DURATION_S)
        assert row["goodput_per_gpu"] == pytest.approx(row["goodput"] / 2)
        per_rate = json.loads(out.with_name(f"sweep.rate-{rate:g}.json").read_text())
        assert per_rate["metrics"]["failed"] == 0 and per_rate["metrics"]["duration"] == DURATION_S
        assert per_rate["config"]["sweep"]["warmup"] == WARMUP_S
    assert sweep["knee"]["rate"] == RATES[-1]
    assert report["config"]["lengths"]["name"] == "random"
