"""scripts/bench_ab_trees.py on CPU: prepare exports branches as trees that each import as `pdserve` from their own
link dir, side by side; the GPU schedule swaps trees between rounds; the comparison of a tree with the baseline
(difference, noise, verdict) on synthetic numbers; a lane's metrics read from its files, and the summary written."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


@pytest.fixture(scope="module")
def ab() -> Any:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "scripts"))
        return importlib.import_module("bench_ab_trees")


def git(repo: Path, *args: str) -> str:
    env = os.environ | GIT_ENV
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


def commit_marker(repo: Path, value: str) -> None:
    (repo / "core" / "marker.py").write_text(f"VALUE = {value!r}\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"marker {value}")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A checkout with a `core` package and package_links.sh on main, and branches ab/x, ab/y that change it."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "core").mkdir()
    (repo / "bench" / "results").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "package_links.sh", repo / "scripts" / "package_links.sh")
    (repo / "core" / "__init__.py").write_text("")
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (repo / "bench" / "results" / "large.json").write_text("{}")
    git(repo, "init", "-q", "-b", "main")
    commit_marker(repo, "base")
    for name in ("x", "y"):
        git(repo, "checkout", "-q", "-b", f"ab/{name}", "main")
        commit_marker(repo, name)
    git(repo, "checkout", "-q", "main")
    return repo


def imported_marker(env: dict[str, str]) -> str:
    code = "import pdserve.core.marker as m; print(m.VALUE)"
    return subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout


def test_prepared_trees_import_as_pdserve_from_their_own_link_dirs(ab: Any, repo: Path, tmp_path: Path) -> None:
    records = ab.prepare(repo, ["ab/x", "ab/y"], repo / ".ab")
    assert [r["name"] for r in records] == ["on", "x", "y"]
    assert records[0]["commit"] == git(repo, "rev-parse", "main").strip()  # the branches' base
    assert records[1]["commit"] == git(repo, "rev-parse", "ab/x").strip() and records[1]["branch"] == "ab/x"
    exported = sorted(p.name for p in (repo / ".ab" / "x").iterdir())
    assert exported == ["AB_TREE.json", "core", "pyproject.toml", "scripts"]  # no bench/, no tests
    assert git(repo, "status", "--porcelain") == ""  # .ab/ is ignored through info/exclude
    trees = ab.load_trees(repo / ".ab")
    assert [t["name"] for t in trees] == ["on", "x", "y"]
    links = {t["name"]: ab.link_tree(t, tmp_path / "pkg" / t["name"]) for t in trees}
    # NOTE: the parent's PYTHONPATH names another tree's links and the checkout: a lane must drop both
    base = os.environ | {"PYTHONPATH": os.pathsep.join([str(links["on"]), str(ROOT), str(tmp_path / "site")])}
    for name, want in (("on", "base"), ("x", "x"), ("y", "y")):
        env = ab.lane_env(base, links[name], "", tmp_path / f"tmp-{name}", 2)
        assert env["PYTHONPATH"].split(os.pathsep) == [str(links[name]), str(tmp_path / "site")]
        assert imported_marker(env).strip() == want
    assert ab.load_trees(repo / ".ab", ["y"])[1]["name"] == "y" and len(ab.load_trees(repo / ".ab", ["y"])) == 2


def test_the_second_round_swaps_gpus(ab: Any) -> None:
    four = ab.schedule(["on", "a", "b", "c"], 4, 2)
    assert four == [[[("on", 0), ("a", 1), ("b", 2), ("c", 3)]], [[("on", 3), ("a", 2), ("b", 1), ("c", 0)]]]
    two = ab.schedule(["on", "a"], 2, 2)
    assert two == [[[("on", 0), ("a", 1)]], [[("on", 1), ("a", 0)]]]  # on one mechanism a call: an exact swap
    batches = ab.schedule(["on", "a", "b", "c"], 2, 1)
    assert batches == [[[("on", 0), ("a", 1)], [("b", 0), ("c", 1)]]]
    padded = ab.schedule(["on", "a", "b"], 4, 1)
    assert padded == [[[("on", 0), ("a", 1), ("b", 2), ("on.2", 3)]]] and ab.tree_of("on.2") == "on"


def runs_of(table: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    """{lane: [metrics of round 1, round 2, ...]} as collect() gives them."""
    return [{"tree": ab_tree(lane), "lane": lane, "round": r + 1, "metrics": m}
            for lane, rounds in table.items() for r, m in enumerate(rounds)]  # fmt: skip


def ab_tree(lane: str) -> str:
    return lane.split(".", 1)[0]


def test_a_difference_counts_when_it_passes_both_spreads_in_every_round(ab: Any) -> None:
    runs = runs_of({
        "on": [{"m": 10.0, "n": 5.0}, {"m": 10.2, "n": 5.0}],
        "slow": [{"m": 11.0, "n": 5.1}, {"m": 11.1, "n": 4.9}],  # m: +1.0, +0.9; n: +0.1, -0.1
        "same": [{"m": 10.1, "n": 5.0}, {"m": 10.05, "n": 5.0}],
        "fast": [{"m": 9.0}, {"m": 9.1}],
        "noisy": [{"m": 10.5}, {"m": 11.5}],  # +0.5, +1.3: mean 0.9, but its own spread is 1.0
        "near": [{"m": 10.3}, {"m": 10.5}],  # +0.3, +0.3: past the noise (0.2) but not twice it
    })  # fmt: skip
    result = ab.compare(runs)
    m = result["slow"]["rows"]["m"]
    assert m["on"] == [10.0, 10.2] and m["off"] == [11.0, 11.1]
    assert m["diff"] == pytest.approx(0.95) and m["noise"] == pytest.approx(0.2) and m["beyond_noise"]
    assert m["diff_pct"] == pytest.approx(100 * 0.95 / 10.1)
    assert not result["slow"]["rows"]["n"]["beyond_noise"]  # the rounds disagree in sign
    assert result["slow"]["verdict"] == "keep" and result["slow"]["slower_without"] == ["m"]
    assert result["same"]["verdict"] == "delete" and not result["same"]["rows"]["m"]["beyond_noise"]
    assert result["fast"]["verdict"] == "delete (faster without)" and result["fast"]["faster_without"] == ["m"]
    noisy = result["noisy"]["rows"]["m"]
    assert noisy["diff"] == pytest.approx(0.9) and noisy["noise"] == pytest.approx(1.0) and not noisy["beyond_noise"]
    near = result["near"]["rows"]["m"]
    assert near["diff"] == pytest.approx(0.3) and near["noise"] == pytest.approx(0.2) and not near["beyond_noise"]
    on_its_path = ab.compare(runs, {"slow": ("n",)})["slow"]  # m is beyond noise, but off the mechanism's path
    assert on_its_path["verdict"] == "delete" and on_its_path["other_beyond_noise"] == ["m"]
    assert on_its_path["judged_on"] == ["n"] and result["slow"]["judged_on"] == ["m", "n"]


def test_baseline_replicas_widen_the_noise_and_one_round_gives_none(ab: Any) -> None:
    runs = runs_of({"on": [{"m": 10.0}, {"m": 10.0}], "on.2": [{"m": 10.6}], "x": [{"m": 10.5}, {"m": 10.5}]})
    row = ab.compare(runs)["x"]["rows"]["m"]
    assert row["on"] == [10.3, 10.0]  # round 1: the mean of both baseline lanes
    assert row["noise"] == pytest.approx(0.6) and row["diff"] == pytest.approx(0.35) and not row["beyond_noise"]
    single = ab.compare(runs_of({"on": [{"m": 10.0}], "x": [{"m": 12.0}]}))["x"]
    assert single["rows"]["m"]["noise"] is None and single["verdict"].startswith("n/a")
    assert ab.compare(runs_of({"on": [{"m": 1.0}], "x": [{"z": 1.0}]}))["x"]["verdict"] == "n/a: no data"


def write_lane(folder: Path, lane: str, rnd: int, ttft: float, itl: float, failed: int = 0) -> None:
    (folder / "serving").mkdir(parents=True)
    record = {"tree": ab_tree(lane), "lane": lane, "round": rnd, "gpu": {"index": str(rnd - 1), "name": "H"},
              "steps": {"micro": {"seconds": 40.0}, "colocated": {"skipped": "30 s left"}}}  # fmt: skip
    (folder / "lane.json").write_text(json.dumps(record))
    micro = {"prefill": {"ttft_median_ms": ttft, "median_ms": ttft + 0.1}, "decode": {"step_ms": 0.7}}
    (folder / "micro.json").write_text(json.dumps(micro))
    tags = {"short": {"median_itl_ms": itl, "p99_itl_ms": 3 * itl}, "long": {"median_ttft_ms": 80.0}}
    report = {"metrics": {"failed": 0}, "metrics_by_tag": tags}
    (folder / "serving" / "interference-disagg.json").write_text(json.dumps(report))
    exact = {"metrics": {"failed": failed, "median_ttft_ms": 2.0}, "metrics_by_tag": {}}
    (folder / "serving" / "exact-hit.json").write_text(json.dumps(exact))


def test_lanes_files_make_the_summary_and_its_table(ab: Any, tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    for rnd, (on, off) in enumerate(((15.0, 15.5), (15.1, 15.6)), start=1):
        write_lane(runs_dir / f"r{rnd}" / "on", "on", rnd, on, 4.0)
        write_lane(runs_dir / f"r{rnd}" / "no-x", "no-x", rnd, off, 4.0, failed=rnd - 1)
    runs = ab.collect(runs_dir)
    assert [(r["lane"], r["round"]) for r in runs] == [("no-x", 1), ("on", 1), ("no-x", 2), ("on", 2)]
    assert runs[1]["metrics"] == {
        "prefill 4000, caching off: first token": 15.0, "prefill 4000, caching off: call": 15.1,
        "decode 128 x 128: step": 0.7, "interference-disagg: short ITL p50": 4.0,
        "interference-disagg: short ITL p99": 12.0, "interference-disagg: long TTFT p50": 80.0,
        "exact-hit: TTFT p50": 2.0,
    }  # fmt: skip
    assert "exact-hit: TTFT p50" not in runs[2]["metrics"]  # failed requests: no figure
    trees = [{"name": "on", "commit": "a" * 40, "subject": "base", "path": "/x"}]
    trees.append({"name": "no-x", "commit": "b" * 40, "branch": "ab/no-x", "removed": "1 file changed", "path": "/y"})
    gpus = [{"index": "0", "name": "H", "uuid": "GPU-0"}, {"index": "1", "name": "H", "uuid": "GPU-1"}]
    summary = ab.summarize(runs, trees, gpus, [[[("on", 0), ("no-x", 1)]]], argparse.Namespace(rounds=2), 12.0)
    row = summary["comparisons"]["no-x"]["rows"]["prefill 4000, caching off: first token"]
    assert row["diff"] == pytest.approx(0.5) and row["beyond_noise"]
    assert summary["comparisons"]["no-x"]["rows"]["exact-hit: TTFT p50"]["noise"] is None  # in round 1 only
    assert summary["comparisons"]["no-x"]["verdict"] == "keep" and "path" not in summary["trees"][0]
    out = tmp_path / "out"
    out.mkdir()
    ab.write_outputs(summary, runs_dir, out)
    table = (out / "summary.md").read_text()
    slower = "prefill 4000, caching off: call; prefill 4000, caching off: first token"
    assert f"| no-x | ab/no-x @ bbbbbbbbbb | 1 file changed | **keep** | {slower} | — | — |" in table
    assert "| no-x | prefill 4000, caching off: first token | 15.000 / 15.100 | 15.500 / 15.600 | +0.500 |" in table
    assert json.loads((out / "summary.json").read_text())["comparisons"]["no-x"]["verdict"] == "keep"
    with tarfile.open(out / "ab_runs.tar.gz") as tar:
        assert "runs/r2/no-x/serving/exact-hit.json" in tar.getnames()
