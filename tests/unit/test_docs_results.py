"""The docs quote result files that exist, and bench/results/ holds only what its index lists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "README.md"
RESULT_PATH = re.compile(r"bench/results/[A-Za-z0-9_.\-/]*")
INDEX_ENTRY = re.compile(r"^\| `([^`]+)` \|", re.MULTILINE)
MAX_BENCHMARKS_LINES = 200


def _docs() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def _named_paths(doc: Path) -> set[str]:
    return {m.group(0).rstrip(".,") for m in RESULT_PATH.finditer(doc.read_text(encoding="utf-8"))}


def test_every_results_path_named_in_the_docs_exists() -> None:
    missing = [
        f"{doc.relative_to(ROOT)}: {p}" for doc in _docs() for p in sorted(_named_paths(doc)) if not (ROOT / p).exists()
    ]
    assert missing == []


def test_every_entry_of_bench_results_is_in_its_index() -> None:
    listed = {entry.rstrip("/") for entry in INDEX_ENTRY.findall(INDEX.read_text(encoding="utf-8"))}
    present = {p.name for p in RESULTS.iterdir() if p.name != "README.md"}
    assert sorted(present - listed) == []
    assert sorted(listed - present) == []


def test_benchmarks_doc_fits_in_200_lines() -> None:
    num_lines = len((ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines())
    assert num_lines <= MAX_BENCHMARKS_LINES
