"""router/supervisor.py: readiness comes from what this run's router wrote, not from an old log in the run dir."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pdserve.core.lifecycle import READY_MARK
from pdserve.router.supervisor import Child


def test_an_old_ready_line_in_a_reused_log_does_not_count(tmp_path: Path) -> None:
    log = tmp_path / "router.log"
    log.write_text(f"{READY_MARK} 127.0.0.1:1 (an earlier run)\n")
    child = Child("router", [sys.executable, "-c", "print('starting')"], log)
    child.start(dict(os.environ))
    assert child.proc is not None and child.proc.wait(timeout=30) == 0
    assert "starting" in child.log_text_since_start() and READY_MARK not in child.log_text_since_start()
    assert READY_MARK in log.read_text()
