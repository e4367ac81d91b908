"""scripts/supervisor.py: readiness comes from what this run's router wrote, not from an old log in the run dir."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _supervisor():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("pdserve_supervisor", ROOT / "scripts" / "supervisor.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_an_old_ready_line_in_a_reused_log_does_not_count(tmp_path: Path) -> None:
    sup = _supervisor()
    log = tmp_path / "router.log"
    log.write_text(f"{sup.READY_MARK} 127.0.0.1:1 (an earlier run)\n")
    child = sup.Child("router", [sys.executable, "-c", "print('starting')"], log)
    child.start(dict(os.environ))
    assert child.proc is not None and child.proc.wait(timeout=30) == 0
    assert "starting" in child.log_text_since_start() and sup.READY_MARK not in child.log_text_since_start()
    assert sup.READY_MARK in log.read_text()
