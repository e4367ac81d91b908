"""Print the reliability table (tests/reliability/report.py) at the end of the session."""

from __future__ import annotations

import pytest

from tests.reliability.report import ROWS, table


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if ROWS:
        terminalreporter.section("reliability")
        terminalreporter.write_line(table(ROWS))
