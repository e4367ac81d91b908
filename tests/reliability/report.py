"""The reliability table: each scenario records one row; the session prints them all at the end (conftest)."""

from __future__ import annotations

from typing import NamedTuple


class Row(NamedTuple):
    scenario: str
    requests: int
    failures: int
    """Requests that ended other than as the scenario expects (a crash, a wrong status, a lost stream)."""
    leaked_blocks: int
    recovery_s: float | None
    """Seconds until the cluster served again (None: nothing had to recover)."""


ROWS: list[Row] = []


def record(scenario: str, requests: int, failures: int, leaked_blocks: int, recovery_s: float | None = None) -> None:
    ROWS.append(Row(scenario, requests, failures, leaked_blocks, recovery_s))


def table(rows: list[Row]) -> str:
    head = f"{'scenario':50s} {'requests':>8s} {'failures':>8s} {'leaked blocks':>13s} {'recovery':>9s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        rec = "-" if r.recovery_s is None else f"{r.recovery_s:.2f} s"
        lines.append(f"{r.scenario:50s} {r.requests:8d} {r.failures:8d} {r.leaked_blocks:13d} {rec:>9s}")
    return "\n".join(lines)
