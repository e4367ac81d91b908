"""What the cluster launcher (router/supervisor.py) and the processes it starts agree on.

NOTE: standard library only: the torch-free launcher, the router and the workers all import it.
"""

from __future__ import annotations

import os
from pathlib import Path

STARTUP_ERROR_EXIT = 2
"""Exit code of a process that cannot start (bad flag, missing model, port in use): restarting cannot help."""
READY_MARK = "pdserve router ready on"
"""The start of the router's ready line; the launcher looks for it in the router's log."""
READY_LINE = READY_MARK + " {address}"
"""Printed by the router once it serves (router/server.py)."""
RESTARTS_ENV = "PDSERVE_RESTARTS"
"""Set by the launcher: how many times it restarted this worker (the pdserve_process_restarts metric)."""


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): a worker's start-up time includes the
    interpreter and its imports."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
