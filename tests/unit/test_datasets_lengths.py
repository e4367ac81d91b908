"""The published-length workloads: seeded samplers hit their documented means, stay in bounds, say their source;
a JSONL of real lengths; prompts cut to the model's context; Poisson-scheduled sampled workloads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.router.benchmark import datasets as ds
from pdserve.router.benchmark.lengths import (
    WORKLOADS,
    JsonlWorkload,
    LogNormalLengths,
    fit_to_context,
    workload_named,
)

DOCUMENTED_MEANS = {"chat": (220, 200), "long-input": (4000, 200), "long-context": (12035, 343)}
"""(input, output) means each workload's docstring/source names."""


@pytest.mark.parametrize("name", sorted(DOCUMENTED_MEANS))
def test_synthetic_workloads_hit_their_documented_means(name: str) -> None:
    workload = WORKLOADS[name]
    inputs, outputs = workload.sample(np.random.default_rng(0), 20_000)
    mean_in, mean_out = DOCUMENTED_MEANS[name]
    assert (workload.mean_input_len, workload.mean_output_len) == (mean_in, mean_out)
    assert inputs.mean() == pytest.approx(mean_in, rel=0.03)
    assert outputs.mean() == pytest.approx(mean_out, rel=0.03)
    assert inputs.min() >= workload.input_len.lo and inputs.max() <= workload.input_len.hi
    assert outputs.min() >= workload.output_len.lo and outputs.max() <= workload.output_len.hi
    assert inputs.dtype == np.int64 and workload.source


def test_samples_depend_only_on_the_seed() -> None:
    a = WORKLOADS["chat"].sample(np.random.default_rng(7), 100)
    b = WORKLOADS["chat"].sample(np.random.default_rng(7), 100)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_lognormal_mu_solves_for_the_truncated_mean() -> None:
    dist = LogNormalLengths(mean=300, sigma=1.2, lo=10, hi=2000)
    assert dist.truncated_mean(dist.mu) == pytest.approx(300, rel=1e-6)
    with pytest.raises(ValueError):
        _ = LogNormalLengths(mean=5, sigma=1.0, lo=10, hi=20).mu


def test_jsonl_lengths_are_drawn_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"input_len": 100, "output_len": 5}\n\n{"input_len": 300, "output_len": 7, "x": 1}\n')
    workload = workload_named("jsonl", str(path))
    assert isinstance(workload, JsonlWorkload) and workload.mean_input_len == 200
    inputs, outputs = workload.sample(np.random.default_rng(0), 1000)
    assert set(zip(inputs.tolist(), outputs.tolist(), strict=True)) == {(100, 5), (300, 7)}
    path.write_text('{"input_len": 0, "output_len": 5}\n')
    with pytest.raises(ValueError, match="must be >= 1"):
        JsonlWorkload.read(path)
    with pytest.raises(ValueError):
        workload_named("jsonl")
    with pytest.raises(ValueError, match="unknown workload"):
        workload_named("sharegpt")


def test_prompts_are_cut_to_fit_the_context() -> None:
    inputs, outputs = fit_to_context(np.array([100, 9000, 50]), np.array([10, 300, 5000]), 1024)
    assert inputs.tolist() == [100, 724, 50] and outputs.tolist() == [10, 300, 512]


def test_sampled_workload_is_poisson_over_the_run_with_exact_prompt_lengths() -> None:
    vocab = ds.VocabInfo(512, (2,))
    workload = ds.sampled_workload(vocab, WORKLOADS["chat"], rate=20.0, duration_s=50.0, max_model_len=512, seed=3)
    specs = workload.requests
    times = [s.start_time or 0.0 for s in specs]
    assert len(specs) == pytest.approx(1000, rel=0.1) and times == sorted(times) and times[0] >= 0 and times[-1] < 50
    assert all(s.prompt_len + s.output_len <= 512 and 2 not in s.prompt_ids for s in specs)
    assert {s.tag for s in specs} == {"chat"}
    again = ds.sampled_workload(vocab, WORKLOADS["chat"], rate=20.0, duration_s=50.0, max_model_len=512, seed=3)
    assert again == workload
